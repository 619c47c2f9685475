"""``python -m studies.layout_comparison [overrides]``: the layout comparison's command line (``run.py``)."""

from studies.layout_comparison.run import main

if __name__ == "__main__":
    main()
