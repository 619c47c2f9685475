"""``python -m studies.memory [flags]``: the memory study's command line (``longest_context.py``)."""

from benchmarks.measure import command_line
from studies.memory import longest_context

if __name__ == "__main__":
    command_line(longest_context.__doc__, longest_context.add_arguments, longest_context.run)
