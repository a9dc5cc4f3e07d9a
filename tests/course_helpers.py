"""What the course's grader tests share."""

import pytest

from minivllm.course.grading import CheckFailed


def fails(check, component, *fragments, error=CheckFailed, starts="", **kwargs) -> str:
    """``check(component, **kwargs)`` must raise ``error`` with a message that starts with
    ``starts`` and contains every fragment; returns the message."""
    with pytest.raises(error) as info:
        check(component, **kwargs)
    message = str(info.value)
    assert message.startswith(starts), message
    for fragment in fragments:
        assert fragment in message, message
    return message
