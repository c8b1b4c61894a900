"""Tensor-parallel plumbing: who this rank is (parallel_state), the collectives the
layers use (communication), and the shared-memory channel that carries each step's
input from rank 0 to the other ranks (shm_broadcast)."""
