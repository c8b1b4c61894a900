"""Running the model over several tensor-parallel processes (see multiproc_executor)."""

from pagedserve.executor.multiproc_executor import (
    MultiprocExecutor,
    TensorParallelError,
    validate_tensor_parallel,
)

__all__ = ["MultiprocExecutor", "TensorParallelError", "validate_tensor_parallel"]
