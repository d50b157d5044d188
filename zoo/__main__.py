"""``python -m zoo``: the zoo's command line (:mod:`zoo.cli`); ``python -m zoo export`` writes a checkpoint of a
Hugging Face model as a Hugging Face directory (:mod:`zoo.export`)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        from zoo.export import main as export

        export(sys.argv[2:])
    else:
        from zoo.cli import main

        main()
