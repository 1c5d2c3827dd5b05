"""`python -m minddp <tool> ...`: the command-line tools (see minddp/tools/__init__.py)."""

from minddp.tools import main

if __name__ == "__main__":
    main()
