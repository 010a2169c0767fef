"""The one exception type for bad user input: its message is a single line saying what
is wrong and what to do, printed as-is by the CLI (exit status 2) and the dashboard."""


class PlannerInputError(ValueError):
    """Bad input from the user (config, scenario value, name); never a bug in the planner."""
