from minivllm.executor.abstract import Executor  # noqa: F401
