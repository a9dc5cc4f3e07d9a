"""Errors the front end raises about the engine core (vLLM's names)."""


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process died, or its loop hit a fatal error).

    Every in-flight request fails with this error and so does every new one: the front end
    stays up to say so (/health answers 503) but cannot serve until it is restarted.
    """

    def __init__(self, detail: str = "") -> None:
        msg = "the engine core is dead"
        super().__init__(f"{msg}: {detail}" if detail else msg)
