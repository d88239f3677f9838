"""`python -m dsv4c ...`: the same command line as the `dsv4c` script."""
from dsv4c.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
