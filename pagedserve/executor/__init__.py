"""Running the model: the ModelExecutor contract (abstract.py) and the tensor-parallel
executor over several processes (multiproc_executor.py, imported only when used)."""
