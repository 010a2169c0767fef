"""The one exception type for bad user input: its message is a single line saying what
is wrong and what to do, printed as-is by the CLI (exit status 2) and the dashboard."""

MAX_MESSAGE_CHARS = 500  # a message quotes what it refuses: never a 10 MB field back, on any channel


class PlannerInputError(ValueError):
    """Bad input from the user (config, scenario value, name); never a bug in the planner."""

    def __init__(self, message: str) -> None:
        text = str(message)
        super().__init__(text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 1] + "…")
