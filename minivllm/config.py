"""Engine arguments (what a user may set) and the resolved engine configuration.

``EngineArgs`` keeps vLLM's names so a learner can carry flags between the two projects; it is
flat, one field per command-line flag. ``EngineArgs.create_config()`` resolves every "auto" in one
place — the device, the dtype, the attention backend, the token budget — rejects impossible
combinations with a ``ValueError`` that names the field, before any weight is loaded, and fills
``EngineConfig``: a tree of groups named as vLLM's ``VllmConfig`` (``config.cache_config.block_size``,
``config.model_config.hf_config`` for the model's architecture, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the model's config load only when an engine is configured
    import torch

    from minivllm.model.config import ModelConfig

# dtype names a user may give -> torch.<name>
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
SCHEDULERS = ("v1", "v0")
ATTENTION_BACKENDS = ("torch", "triton")
HASH_ALGOS = ("sha256", "xxhash")
CUSTOM_OPS = ("auto", "all", "none")
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")

# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: a max_model_len past what the model's positions cover is
# refused unless this environment variable is "1" (or "true")
ALLOW_LONG_MAX_MODEL_LEN_ENV = "MINIVLLM_ALLOW_LONG_MAX_MODEL_LEN"

# Default token budget per step when chunked prefill is on. A prefill chunk rides along with the
# decodes almost for free while the step stays memory-bound, i.e. up to the hardware's
# compute/bandwidth ridge point: a few hundred tokens on a datacenter GPU, far fewer on a laptop
# CPU (chapter 05 measures it).
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}
# Default KV cache budget on a CPU, which has no free-memory probe (a GPU's budget is
# gpu_memory_utilization of its memory, less the weights and a forward pass's peak)
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# A scheduler without a model (the simulator, SchedulerConfig()) has no context length to take
# max_model_len from: this one stands in
SCHEDULER_ONLY_MAX_MODEL_LEN = 8192


# What each engine argument's command-line flag says (``--name-with-dashes``, vLLM's names), and
# the values it accepts. The flags themselves are generated from EngineArgs' fields.
_CLI_HELP: dict[str, tuple[str, tuple | None]] = {
    "model": ("local Hugging Face folder or hub name (default: the bundled "
              "SmolLM2-135M-Instruct)", None),
    "tokenizer": ("tokenizer folder or hub name (default: the model's)", None),
    "skip_tokenizer_init": ("token ids in, token ids out (no tokenizer is loaded)", None),
    "revision": ("the hub revision (branch, tag or commit) of the model", None),
    "dtype": ("weights and activations (auto: float32 on a CPU; on a GPU bfloat16, or float16 "
              "below compute capability 8.0 or for a float16 checkpoint)", ("auto", *_DTYPES)),
    "device": ("auto | cpu | cuda | cuda:N", None),
    "seed": ("the engine's random seed", None),
    "block_size": ("tokens per KV cache block", None),
    "num_kv_blocks": ("KV cache blocks (default: from --kv-cache-memory-bytes or "
                      "--gpu-memory-utilization)", None),
    "kv_cache_memory_bytes": (f"bytes for the KV cache (CPU default: "
                              f"{DEFAULT_CPU_KV_CACHE_BYTES / 2 ** 30:g} GiB)", None),
    "gpu_memory_utilization": ("fraction of the GPU's memory the engine may use, "
                               "weights and KV cache together", None),
    "enable_prefix_caching": ("reuse the KV blocks of prompts' shared prefixes", None),
    "prefix_caching_hash_algo": ("how blocks are hashed for the prefix cache", HASH_ALGOS),
    "scheduler": ("v1: one token budget for prefills and decodes; v0: phase-separated",
                  SCHEDULERS),
    "max_num_seqs": ("most requests running at once", None),
    "max_num_batched_tokens": (f"token budget per step (default: {DEFAULT_BATCHED_TOKENS['cpu']} "
                               f"on a CPU, {DEFAULT_BATCHED_TOKENS['cuda']} on a GPU)", None),
    "max_model_len": ("longest prompt + output (default: the model's context length)", None),
    "enable_chunked_prefill": ("cut long prompts into chunks that share steps with decodes",
                               None),
    "long_prefill_token_threshold": ("most tokens one prompt may take in a step (0: no limit)",
                                     None),
    "attention_backend": ("default: triton on CUDA, torch elsewhere", ATTENTION_BACKENDS),
    "enforce_eager": ("no CUDA graphs (nor a CPU's one-call decoder layers)", None),
    "compile": ("torch.compile the model's elementwise parts", None),
    "custom_ops": ("fused Triton kernels for RMSNorm, rotary, SiLU-and-mul (auto: with the "
                   "Triton attention backend, unless --compile)", CUSTOM_OPS),
    "multiprocess": ("run the engine core in its own process", None),
    "trace_steps": ("keep what the last N engine steps scheduled, for get_step_trace() "
                    "(0: off)", None),
    "tensor_parallel_size": ("split the model across this many ranks (torch.distributed: gloo "
                             "on CPU, nccl on GPU)", None),
    "distributed_executor_backend": (
        "mp: one worker process per rank; uni: the runner in the engine core's process (size 1 "
        "only); external_launcher: every rank started by torchrun runs this same command, rank "
        "0 runs the engine. Default: uni at size 1, mp above", EXECUTOR_BACKENDS),
}
_CLI_HELP["model_runner_cls"] = (
    "another model runner as MODULE:CLASS, e.g. minivllm.sim.paced_runner:PacedModelRunner (no "
    "model: each step sleeps its simulated H100 time; for load tests)", None)
# short spellings vLLM also accepts
_CLI_ALIASES = {"tensor_parallel_size": ("-tp",)}


@dataclass
class EngineArgs:
    """Everything that configures an engine. ``None`` / "auto" means: choose for this machine."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None  # defaults to the model folder
    skip_tokenizer_init: bool = False  # token ids in, token ids out (no text)
    revision: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # None on a CPU: DEFAULT_CPU_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # scheduling
    scheduler: str = "v1"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # execution
    attention_backend: str | None = None  # None: "triton" on CUDA, "torch" elsewhere
    enforce_eager: bool = False
    compile: bool = False
    # the fused Triton kernels for RMSNorm (+ residual add), rotary embedding and SiLU-and-mul
    # (vLLM's compilation_config.custom_ops, all or nothing here): "all" uses them, "none" the
    # plain-torch ops, "auto" uses them exactly when attention runs on Triton and compile is off
    # (with compile=True, torch.compile fuses the plain-torch ops instead)
    custom_ops: str = "auto"
    multiprocess: bool = False
    # tensor parallelism: the model's heads, MLP features and vocabulary split across this many
    # ranks (torch.distributed: gloo on CPU, nccl on GPU)
    tensor_parallel_size: int = 1
    # "uni": the model runner in the engine core's process (size 1); "mp": one worker process
    # per rank, spawned by the engine core; "external_launcher": the ranks were started by
    # torchrun (rank 0 runs the engine). None: "uni" at size 1, "mp" above.
    distributed_executor_backend: str | None = None
    # how many recent steps get_step_trace() keeps (what each step scheduled, its duration);
    # 0 turns the trace off. On for LLM and the course; `minivllm serve` defaults to 0, so a
    # server's memory does not grow with its uptime.
    trace_steps: int = 100_000
    # injectable components (the course's exercises plug the learner's classes in here)
    scheduler_cls: type | None = None
    kv_cache_manager_cls: type | None = None
    block_pool_cls: type | None = None
    sampler_cls: type | None = None
    detokenizer_cls: type | None = None  # the front end's incremental detokenizer
    # the model runner: None for the real one; a class or "module:Class" (e.g. the simulator's
    # paced runner, "minivllm.sim.paced_runner:PacedModelRunner", which runs no model)
    model_runner_cls: type | str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        """The fields a command line can set: all but the injectable classes (``*_cls``) that
        only Python can pass (a class given as "module:Class" text has its flag)."""
        hints = typing.get_type_hints(cls)
        return [f for f in dataclasses.fields(cls)
                if not f.name.endswith("_cls") or str in typing.get_args(hints[f.name])]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     defaults: dict | None = None) -> argparse.ArgumentParser:
        """Add one flag per engine argument (``--max-num-seqs`` for ``max_num_seqs``).

        The flags are generated from the fields, so a new field gets its flag; ``defaults``
        overrides a field's default for one command (``minivllm serve`` runs multi-process).
        """
        hints = typing.get_type_hints(cls)
        defaults = defaults or {}
        group = parser.add_argument_group("engine arguments (vLLM's names)")
        for f in cls.cli_fields():
            help_text, choices = _CLI_HELP.get(f.name, ("", None))
            default = defaults.get(f.name, f.default)
            flags = ("--" + f.name.replace("_", "-"), *_CLI_ALIASES.get(f.name, ()))
            kind = hints[f.name]
            if kind is bool:
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                                   help=help_text)
                continue
            base = next(t for t in typing.get_args(kind) or (kind,) if t not in (type(None), type))
            group.add_argument(*flags, type=base, default=default, choices=choices,
                               help=help_text if default is None else f"{help_text} (default: {default})")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The EngineArgs a parsed command line asks for (flags not on it keep their default)."""
        return cls(**{f.name: getattr(args, f.name) for f in cls.cli_fields()
                      if hasattr(args, f.name)})

    def create_config(self) -> "EngineConfig":
        self._check_types()
        from minivllm.model.config import ModelConfig
        from minivllm.model_hub import resolve_model

        model_path = resolve_model(self.model, revision=self.revision)
        hf_config = ModelConfig.from_pretrained(model_path)

        device = _resolve_device(self.device)
        dtype = _resolve_dtype(self.dtype, device, hf_config.torch_dtype)

        max_model_len, hf_config = _resolve_max_model_len(self.max_model_len, hf_config)

        chunked = self.enable_chunked_prefill and self.scheduler == "v1"
        budget = self.max_num_batched_tokens
        if budget is None:
            base = DEFAULT_BATCHED_TOKENS["cuda" if device.type == "cuda" else "cpu"]
            budget = base if chunked else max(max_model_len, base)
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget}")
        if not chunked and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({max_model_len}): without chunked prefill a whole prompt must fit in one step. "
                "Raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill."
            )

        backend, use_custom_ops = self.resolve_kernels(device)

        tp = self.tensor_parallel_size
        executor = self.distributed_executor_backend or ("uni" if tp == 1 else "mp")
        if executor == "external_launcher" and int(os.environ.get("WORLD_SIZE", "0")) != tp:
            raise ValueError(
                "distributed_executor_backend='external_launcher' needs one process per rank "
                f"started by torchrun: WORLD_SIZE is {os.environ.get('WORLD_SIZE')!r}, "
                f"tensor_parallel_size {tp}")
        if executor == "uni" and tp > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank in the engine core's process; "
                f"tensor_parallel_size={tp} needs 'mp'")
        from minivllm.model.parallel_layers import check_tensor_parallel_size

        check_tensor_parallel_size(hf_config, tp)
        if tp > 1 and device.type == "cuda":
            import torch

            n = torch.cuda.device_count()
            if n < tp:
                raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; torch sees {n}")

        return EngineConfig(
            model_config=EngineModelConfig(
                model_path=model_path,
                tokenizer_path=self.tokenizer or model_path,
                skip_tokenizer_init=self.skip_tokenizer_init,
                revision=self.revision,
                dtype=dtype,
                seed=self.seed,
                max_model_len=max_model_len,
                hf_config=hf_config,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                enable_chunked_prefill=chunked,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=tp,
                distributed_executor_backend=executor,
            ),
            device_config=DeviceConfig(device=device),
            compilation_config=CompilationConfig(
                attention_backend=backend,
                use_cuda_graph=device.type == "cuda" and not self.enforce_eager,
                compile=self.compile,
                use_custom_ops=use_custom_ops,
                use_cpu_layer_loop=(device.type == "cpu" and not self.enforce_eager
                                     and tp == 1 and not self.compile and not use_custom_ops),
            ),
            scheduler=self.scheduler,
            multiprocess=self.multiprocess,
            trace_steps=self.trace_steps,
            scheduler_cls=self.scheduler_cls,
            kv_cache_manager_cls=self.kv_cache_manager_cls,
            block_pool_cls=self.block_pool_cls,
            sampler_cls=self.sampler_cls,
            detokenizer_cls=self.detokenizer_cls,
            model_runner_cls=_resolve_class("model_runner_cls", self.model_runner_cls),
        )

    def resolve_kernels(self, device: torch.device) -> tuple[str, bool]:
        """The one place that picks the attention backend and the elementwise kernels.

        Default: Triton on CUDA when triton is installed, plain torch elsewhere. Asking for
        Triton where it cannot run is an error that says what is missing.
        """
        from minivllm.kernels import triton_unavailable_reason

        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.custom_ops not in CUSTOM_OPS:
            raise ValueError(f"custom_ops must be one of {CUSTOM_OPS}, got {self.custom_ops!r}")
        missing = triton_unavailable_reason(device.type)
        backend = self.attention_backend or (
            "triton" if device.type == "cuda" and missing is None else "torch")
        if backend == "triton" and missing:
            raise ValueError(f"attention_backend='triton' cannot run here: {missing}")
        if self.custom_ops == "all":
            if missing:
                raise ValueError(f"custom_ops='all' cannot run here: {missing}")
            if self.compile:
                raise ValueError(
                    "custom_ops='all' and compile=True both replace the elementwise ops: "
                    "choose one (compile=True with custom_ops='auto' or 'none')"
                )
        use_custom_ops = self.custom_ops == "all" or (
            self.custom_ops == "auto" and backend == "triton" and not self.compile)
        return backend, use_custom_ops

    def _check_types(self) -> None:
        def need_int(name: str, lo: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")

        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a path or a hub name (str), got {self.model!r}")
        need_int("seed", 0)
        need_int("block_size", 1)
        need_int("num_kv_blocks", 1, optional=True)
        need_int("kv_cache_memory_bytes", 1, optional=True)
        need_int("max_num_seqs", 1)
        need_int("max_num_batched_tokens", 1, optional=True)
        need_int("max_model_len", 2, optional=True)
        need_int("long_prefill_token_threshold", 0)
        need_int("trace_steps", 0)
        need_int("tensor_parallel_size", 1)
        if self.distributed_executor_backend not in (None,) + EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.prefix_caching_hash_algo == "xxhash":
            try:
                import xxhash  # noqa: F401
            except ImportError:
                raise ValueError(
                    "prefix_caching_hash_algo='xxhash' needs the xxhash package: pip install xxhash"
                ) from None
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in ("skip_tokenizer_init", "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                     "compile", "multiprocess"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


# -- the resolved configuration: a tree of groups, as vLLM's VllmConfig ------------------------
#
# EngineArgs is flat (one field per command-line flag); EngineConfig groups the resolved values by
# the component that reads them, with vLLM's group names (model_config, cache_config,
# scheduler_config, parallel_config, device_config, compilation_config), so a reader finds
# ``config.cache_config.block_size`` here where vLLM has ``vllm_config.cache_config.block_size``.
#
# One naming choice: minivllm.model.config.ModelConfig is the model's *architecture* (layers,
# heads, rope; read from config.json), which chapters 01-02 build the model from. The engine's
# model group is therefore EngineModelConfig, reached as ``config.model_config`` (vLLM's attribute
# name), and the architecture sits inside it as ``config.model_config.hf_config``, where vLLM keeps
# the Hugging Face config of the model.


@dataclass
class EngineModelConfig:
    """Which model the engine serves, and in which numbers."""

    model_path: str  # a local folder (a hub name is downloaded and resolved to its folder)
    tokenizer_path: str
    skip_tokenizer_init: bool
    revision: str | None
    dtype: torch.dtype
    seed: int
    max_model_len: int  # longest prompt + output (the scheduler's copy: scheduler_config)
    hf_config: ModelConfig  # the architecture, from config.json (minivllm.model.config)


@dataclass
class CacheConfig:
    """The paged KV cache: block size, how many blocks (or the memory that decides it), prefix
    caching."""

    block_size: int
    num_kv_blocks: int | None  # None: from kv_cache_memory_bytes or gpu_memory_utilization
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str


@dataclass
class SchedulerConfig:
    """The knobs a scheduler reads (also used without a model, by the simulator). The
    defaults are EngineArgs' (resolved for a CPU), for the simulator and tests that build one
    directly; an engine's come from ``EngineArgs.create_config``."""

    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS["cpu"]
    max_model_len: int = SCHEDULER_ONLY_MAX_MODEL_LEN
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    long_prefill_token_threshold: int = EngineArgs.long_prefill_token_threshold


@dataclass
class ParallelConfig:
    """How the model is split across ranks, and who starts the ranks."""

    tensor_parallel_size: int = EngineArgs.tensor_parallel_size
    distributed_executor_backend: str = "uni"  # "uni" | "mp" | "external_launcher"


@dataclass
class DeviceConfig:
    device: torch.device


@dataclass
class CompilationConfig:
    """Which kernels a step runs: the attention backend (vLLM keeps it in its own attention
    config), CUDA graphs, torch.compile, and the fused Triton elementwise kernels."""

    attention_backend: str  # "torch" | "triton"
    use_cuda_graph: bool
    compile: bool
    use_custom_ops: bool  # fused Triton elementwise kernels (resolved from custom_ops)
    # a CPU step's decoder layers in one C++ call (``worker/cpu_layers.py``), where it can serve
    use_cpu_layer_loop: bool = False


@dataclass
class EngineConfig:
    """The resolved configuration every engine component reads (no "auto" left)."""

    model_config: EngineModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    compilation_config: CompilationConfig
    # the engine's shape and its components
    scheduler: str = EngineArgs.scheduler  # "v1" | "v0" (ignored when scheduler_cls is given)
    multiprocess: bool = EngineArgs.multiprocess  # the engine core in its own process
    trace_steps: int = EngineArgs.trace_steps
    scheduler_cls: type | None = None
    kv_cache_manager_cls: type | None = None
    block_pool_cls: type | None = None
    sampler_cls: type | None = None
    detokenizer_cls: type | None = None
    model_runner_cls: type | None = None


def _resolve_max_model_len(asked: int | None, model_config: ModelConfig) -> tuple[int, ModelConfig]:
    """The context length to serve: the model's own by default; a longer one only on request.

    Past ``max_position_embeddings`` (stretched by rope scaling) the rotary table has no row: the
    model would read positions it was never trained on. With the override the table is extended
    to ``max_model_len`` (the rotary formula is defined everywhere) and a warning says that the
    outputs may be wrong.
    """
    derived = model_config.derived_max_model_len
    if asked is None:
        return max(derived, 2), model_config
    if asked < 2:
        raise ValueError(f"max_model_len must be >= 2, got {asked}")
    if asked > derived:
        msg = (f"max_model_len ({asked}) is longer than the model's derived maximum length "
               f"({derived}: max_position_embeddings in its config.json, with rope scaling)")
        if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "").lower() not in ("1", "true"):
            raise ValueError(
                f"{msg}. Positions past it were never trained and may give wrong outputs. "
                f"To allow it anyway, set the environment variable {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1"
            )
        warnings.warn(f"{msg}; allowed by {ALLOW_LONG_MAX_MODEL_LEN_ENV}: outputs past "
                      f"{derived} tokens may be wrong", stacklevel=3)
        if asked > model_config.max_position_embeddings:  # the rotary table must reach it
            model_config = dataclasses.replace(model_config, max_position_embeddings=asked)
    return asked, model_config


def _resolve_class(name: str, value: type | str | None) -> type | None:
    """A class given as itself or as "package.module:Class" (what a command line can pass)."""
    if value is None or isinstance(value, type):
        return value
    module, sep, attr = str(value).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{name} must be a class or 'package.module:Class', got {value!r}")
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{name}: cannot import {value!r} ({e})") from None


def _resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
    return dev


def _resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: torch.dtype) -> torch.dtype:
    import torch

    if dtype != "auto":
        return getattr(torch, _DTYPES[dtype])
    if device.type != "cuda":
        return torch.float32  # CPUs run fp32 fastest and exactly
    # on a GPU, a 16-bit type the device runs natively: bfloat16 from compute capability 8.0
    # (A100, H100...); below (T4, V100) float16, since bfloat16 is emulated there, slower than
    # float32 (torch.cuda.is_bf16_supported() says yes anyway). A float16 checkpoint stays float16.
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8 or checkpoint_dtype == torch.float16:
        return torch.float16
    return torch.bfloat16
