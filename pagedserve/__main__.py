"""`python -m pagedserve ...`: the `pagedserve` command, where the console script is not on
PATH (a virtual environment that is not activated, a scripted `sys.executable` call)."""

from pagedserve.entrypoints.cli import run

if __name__ == "__main__":
    run()
