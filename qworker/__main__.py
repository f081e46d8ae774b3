"""`python -m qworker ...` is the `qworker` command."""

from qworker.cli import main

if __name__ == "__main__":
    main()
