"""``python -m zoo``: the zoo's command line (see :mod:`zoo.cli`)."""

from zoo.cli import main

if __name__ == "__main__":
    main()
