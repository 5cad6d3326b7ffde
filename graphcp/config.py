"""EngineArgs: every engine setting, its SGLang-style flag, and its validation, in one place."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from graphcp.errors import ConfigError
from graphcp.kernels.registry import ATTENTION_CHOICES

STRATEGIES = ("zigzag", "interleave")
BACKENDS = ("auto", "trtllm_mha", "flashattention", "torch")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = ("auto", *TORCH_DTYPES)
DEVICES = ("auto", "cuda", "cpu")
MOE_A2A_BACKENDS = ("none", "all_to_all")
DISAGGREGATION_MODES = ("null", "prefill")
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp")
TRANSFER_PROTOCOLS = ("auto", "tcp", "rdma")


@dataclass(frozen=True)
class EngineArgs:
    model_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    attn_cp_size: int = 1
    enable_prefill_cp: bool = False
    cp_strategy: str | None = None
    attention_backend: str = "auto"
    attention_kernel: str = "auto"
    disable_cuda_graph: bool = False
    cuda_graph_buckets: tuple[int, ...] | None = None
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None     # weights + KV pool / device memory (None: SGLang's
                                                 # default on GPUs; a fifth of free memory on CPU)
    gpu_memory_gib: float | None = None          # size the pool as if the device had this memory
    capture_plan: str | None = None
    max_batch_requests: int = 8
    max_state_requests: int | None = None   # models with per-request state: requests that hold it
                                            # at once (None: 4 x max_batch_requests)
    rank_timeout_s: float = 60.0
    ffn_tp_size: int | None = None   # None = the TP world; or tp / (dp x attn-cp-size) to keep the FFN
                                     # with attention TP: no layer communicator, FFN weights replicated per CP rank
    ep_size: int = 1                 # expert parallelism: experts split over ep ranks of the TP world
    moe_a2a_backend: str = "none"    # MoE token flow: none (gather / reduce-scatter) | all_to_all
    disaggregation_mode: str = "null"            # "prefill": a PD prefill worker, engine.transfer_kv sends KV
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_transfer_protocol: str = "auto"   # auto: rdma on CUDA where an RDMA device exists, else tcp
    disaggregation_transfer_timeout_s: float = 30.0
    disaggregation_bootstrap_port: int | None = None  # SGLang PD: serve SGLang's bootstrap and protocol here
    enable_dsa_cache_layer_split: bool = False       # each CP rank keeps only its layers' KV (prefill, interleave)
    enable_kv_cache_sharding: bool = False           # each KV page once per CP group (kv/sharding)
    speculative_aux_hidden_layers: tuple[int, ...] | None = None   # EAGLE-3: residual streams to return
    enable_adaptive_cp: bool = False                 # short requests whole on one CP rank, long ones zigzag
    adaptive_cp_threshold: int | None = None         # new tokens from which a request is split (None: model)

    def __post_init__(self) -> None:
        if self.cuda_graph_buckets is not None:
            object.__setattr__(self, "cuda_graph_buckets", tuple(int(b) for b in self.cuda_graph_buckets))
        if self.speculative_aux_hidden_layers is not None:
            object.__setattr__(self, "speculative_aux_hidden_layers", tuple(self.speculative_aux_hidden_layers))
        self._validate()

    # -- validation -------------------------------------------------------------------------
    def _validate(self) -> None:
        if not self.model_path:
            raise ConfigError("--model-path is required: a directory with config.json and *.safetensors, "
                              "or a .gguf file")
        if is_gguf(self.model_path):
            check_gguf_file(self.model_path)
        elif not os.path.isdir(self.model_path):
            raise ConfigError(f"--model-path {self.model_path!r} is not a directory")
        else:
            _check_hf_dir(self.model_path)
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--device", self.device, DEVICES)
        _choice("--attention-backend", self.attention_backend, BACKENDS)
        _choice("--attention-kernel", self.attention_kernel, ATTENTION_CHOICES)
        if self.cp_strategy is not None:
            _choice("--cp-strategy", self.cp_strategy, STRATEGIES)
        for flag, value in (("--tp", self.tp_size), ("--dp", self.dp_size), ("--pp", self.pp_size),
                            ("--attn-cp-size", self.attn_cp_size), ("--page-size", self.page_size),
                            ("--max-batch-requests", self.max_batch_requests),
                            ("--max-state-requests", self.resolved_max_state_requests)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"--page-size must be a power of two, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"--max-total-tokens must be >= --page-size ({self.page_size}), "
                              f"got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"--mem-fraction-static must be between 0 and 1 (the fraction of the "
                              f"device's memory for weights and KV pool), got {self.mem_fraction_static}")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ConfigError(f"--gpu-memory-gib must be > 0, got {self.gpu_memory_gib}")
        if self.enable_prefill_cp and self.cp_strategy is None:
            raise ConfigError("--cp-strategy must be set when --enable-prefill-cp is enabled (zigzag | interleave)")
        if self.attn_cp_size > 1 and not self.enable_prefill_cp:
            raise ConfigError("--attn-cp-size > 1 needs --enable-prefill-cp (and --cp-strategy)")
        if self.tp_size % (self.dp_size * self.attn_cp_size):
            raise ConfigError(f"--tp must be divisible by --dp x --attn-cp-size "
                              f"(tp={self.tp_size}, dp={self.dp_size}, attn-cp-size={self.attn_cp_size})")
        if self.ffn_tp_size is not None and self.ffn_tp_size not in (self.tp_size, self.attn_tp_size):
            raise ConfigError(f"--ffn-tp-size must be {self.tp_size} (the TP world) or {self.attn_tp_size} "
                              f"(the attention TP size), got {self.ffn_tp_size}")
        _choice("--moe-a2a-backend", self.moe_a2a_backend, MOE_A2A_BACKENDS)
        if not isinstance(self.ep_size, int) or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ConfigError(f"--ep must be a positive divisor of --tp (expert TP = tp / ep), "
                              f"got ep={self.ep_size!r} with tp={self.tp_size}")
        if self.cuda_graph_buckets is not None:
            if not self.cuda_graph_buckets or any(b < 1 for b in self.cuda_graph_buckets):
                raise ConfigError("--cuda-graph-buckets must be positive token counts, e.g. 32 64 128")
        if self.rank_timeout_s <= 0:
            raise ConfigError("--rank-timeout must be > 0 seconds")
        _choice("--disaggregation-mode", self.disaggregation_mode, DISAGGREGATION_MODES)
        _choice("--disaggregation-transfer-backend", self.disaggregation_transfer_backend, TRANSFER_BACKENDS)
        _choice("--disaggregation-transfer-protocol", self.disaggregation_transfer_protocol, TRANSFER_PROTOCOLS)
        if self.disaggregation_transfer_backend == "mooncake_tcp" and self.disaggregation_transfer_protocol == "rdma":
            raise ConfigError("--disaggregation-transfer-backend mooncake_tcp sends over tcp; drop "
                              "--disaggregation-transfer-protocol rdma or use "
                              "--disaggregation-transfer-backend mooncake")
        if self.disaggregation_transfer_timeout_s <= 0:
            raise ConfigError("--disaggregation-transfer-timeout must be > 0 seconds")
        port = self.disaggregation_bootstrap_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"--disaggregation-bootstrap-port must be a TCP port (1-65535), got {port!r}")
        if port is not None and self.disaggregation_mode != "prefill":
            raise ConfigError("--disaggregation-bootstrap-port needs --disaggregation-mode prefill")
        if self.enable_dsa_cache_layer_split:
            if self.disaggregation_mode != "prefill":
                raise ConfigError("--enable-dsa-cache-layer-split needs --disaggregation-mode prefill")
            if self.cp_size < 2 or self.cp_strategy != "interleave":
                raise ConfigError("--enable-dsa-cache-layer-split needs --enable-prefill-cp with --cp-strategy "
                                  "interleave and --attn-cp-size >= 2")
            if self.pp_size != 1:
                raise ConfigError("--enable-dsa-cache-layer-split needs --pp 1")
        if self.enable_kv_cache_sharding:
            self._check_kv_sharding()
        _check_aux_layers(self.speculative_aux_hidden_layers)
        if self.enable_adaptive_cp and (self.cp_size < 2 or self.cp_strategy != "zigzag"):
            raise ConfigError("--enable-adaptive-cp needs --enable-prefill-cp, --cp-strategy zigzag and "
                              "--attn-cp-size >= 2")
        if self.adaptive_cp_threshold is not None and (not self.enable_adaptive_cp or self.adaptive_cp_threshold < 1):
            raise ConfigError("--adaptive-cp-threshold must be a token count >= 1 and needs --enable-adaptive-cp")
        if self.capture_plan is not None and not os.path.isfile(self.capture_plan):
            raise ConfigError(f"--capture-plan {self.capture_plan!r} does not exist")

    def _check_kv_sharding(self) -> None:
        """What ``--enable-kv-cache-sharding`` serves: one CP group per stage, each page once."""
        flag = "--enable-kv-cache-sharding"
        if self.cp_size < 2:
            raise ConfigError(f"{flag} needs --enable-prefill-cp with --attn-cp-size >= 2 (it "
                              "shards the KV pages over the CP group)")
        refused = (("--pp > 1", self.pp_size > 1), ("--dp > 1", self.dp_size > 1),
                   ("--enable-dsa-cache-layer-split", self.enable_dsa_cache_layer_split),
                   ("--enable-adaptive-cp", self.enable_adaptive_cp))
        for what, bad in refused:
            if bad:
                raise ConfigError(f"{flag} does not combine with {what}; drop one of them")

    # -- derived ----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def cp_size(self) -> int:
        return self.attn_cp_size if self.enable_prefill_cp else 1

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // (self.dp_size * self.attn_cp_size)

    @property
    def resolved_ffn_tp_size(self) -> int:
        return self.ffn_tp_size or self.tp_size

    @property
    def expert_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def resolved_max_state_requests(self) -> int:
        given = self.max_state_requests
        return 4 * self.max_batch_requests if given is None else given

    @property
    def resolved_cp_strategy(self) -> str:
        """The layout: the one asked for, or zigzag (a one-rank zigzag when CP is off)."""
        return self.cp_strategy or "zigzag"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_backend(self) -> str:
        return "trtllm_mha" if self.attention_backend == "auto" else self.attention_backend

    def resolved_transfer_protocol(self) -> str:
        if self.disaggregation_transfer_backend == "mooncake_tcp":
            return "tcp"
        if self.disaggregation_transfer_protocol != "auto":
            return self.disaggregation_transfer_protocol
        rdma = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
        return "rdma" if rdma and self.resolved_device() == "cuda" else "tcp"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # -- CLI --------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, require_model: bool = True) -> None:
        add, d = parser.add_argument, _DEFAULTS
        add("--model-path", required=require_model,
            help="HF checkpoint dir (config.json + safetensors) or a .gguf file")
        add("--dtype", default=d["dtype"], choices=DTYPES,
            help="compute dtype: auto is bf16 on CUDA, fp32 on CPU (FP8 weights stay FP8)")
        add("--device", default=d["device"], choices=DEVICES,
            help="auto: CUDA where a GPU is visible, else CPU")
        add("--tp", "--tp-size", dest="tp_size", type=int, default=d["tp_size"],
            help="TP world size (ranks per pipeline stage) = dp x attn-cp-size x attention TP")
        add("--dp", "--dp-size", dest="dp_size", type=int, default=d["dp_size"],
            help="data-parallel attention groups (requests divided between them)")
        add("--pp", "--pp-size", dest="pp_size", type=int, default=d["pp_size"],
            help="pipeline stages (layers split between them; eager)")
        add("--attn-cp-size", type=int, default=d["attn_cp_size"],
            help="ranks of an attention context-parallel group (needs --enable-prefill-cp)")
        add("--enable-prefill-cp", action="store_true",
            help="split each prompt's tokens over the attention CP group")
        add("--cp-strategy", default=d["cp_strategy"], help="zigzag | interleave")
        add("--attention-backend", default=d["attention_backend"],
            help="auto | trtllm_mha | flashattention | torch")
        add("--attention-kernel", default=d["attention_kernel"],
            help="auto (flashinfer where installed and it fits, else Triton on CUDA, torch on CPU) | flashinfer | "
                 "triton | torch")
        add("--disable-cuda-graph", action="store_true",
            help="run every batch eagerly (no captured graphs)")
        add("--cuda-graph-buckets", type=int, nargs="+", default=d["cuda_graph_buckets"],
            help="CP-local padded token counts to capture, e.g. 32 64 128")
        add("--page-size", type=int, default=d["page_size"],
            help="tokens per KV page (a power of two)")
        add("--max-total-tokens", type=int, default=d["max_total_tokens"],
            help="KV pool capacity in tokens per rank (default: from --mem-fraction-static)")
        add("--mem-fraction-static", type=float, default=d["mem_fraction_static"],
            help="fraction of the device's memory for weights + KV pool, as SGLang (default: "
                 "SGLang's rule on GPUs; a fifth of free memory on CPU)")
        add("--gpu-memory-gib", type=float, default=d["gpu_memory_gib"],
            help="size the KV pool as if each rank's device had this much memory (GiB)")
        add("--capture-plan", default=d["capture_plan"],
            help="a capture plan JSON written by capture/warmup.py (its buckets are captured)")
        add("--max-batch-requests", type=int, default=d["max_batch_requests"],
            help="static request capacity of the graphs")
        add("--max-state-requests", type=int, default=d["max_state_requests"],
            help="models with per-request recurrent state (linear attention): requests that "
                 "hold it at once (default 4 x --max-batch-requests)")
        add("--rank-timeout", dest="rank_timeout_s", type=float, default=d["rank_timeout_s"],
            help="seconds before a silent rank makes prefill fail")
        add("--ffn-tp-size", type=int, default=d["ffn_tp_size"],
            help="dense FFN TP size: the TP world (default) or the attention TP size (FFN replicated per CP rank)")
        add("--ep", "--ep-size", dest="ep_size", type=int, default=d["ep_size"],
            help="expert-parallel size: experts split over ep ranks, expert TP = tp / ep")
        add("--moe-a2a-backend", default=d["moe_a2a_backend"],
            help="MoE token flow: none (all-gather, local experts, reduce-scatter) | all_to_all (dispatch/combine)")

        add("--disaggregation-mode", default=d["disaggregation_mode"],
            help="null | prefill (a PD prefill worker: transfer_kv)")
        add("--disaggregation-transfer-backend", default=d["disaggregation_transfer_backend"],
            help="mooncake | mooncake_tcp")
        add("--disaggregation-transfer-protocol", default=d["disaggregation_transfer_protocol"],
            help="auto (rdma on CUDA where an RDMA device exists, else tcp) | tcp | rdma")
        add("--disaggregation-transfer-timeout", dest="disaggregation_transfer_timeout_s", type=float,
            default=d["disaggregation_transfer_timeout_s"],
            help="seconds a KV transfer may make no progress before it fails with TransferError")
        add("--disaggregation-bootstrap-port", type=int, default=d["disaggregation_bootstrap_port"],
            help="speak SGLang's PD protocol (SGLang 0.5.23): its bootstrap server listens on this port")
        add("--enable-dsa-cache-layer-split", action="store_true",
            help="each CP rank keeps only its contiguous layers' KV (prefill mode, interleave, PP 1)")
        add("--enable-kv-cache-sharding", action="store_true",
            help="store each KV page once per CP group (not on every CP rank): the group holds C x "
                 "--max-total-tokens (SGLang's flag)")
        add("--enable-adaptive-cp", action="store_true",
            help="per batch: short requests whole on one CP rank (balanced), long ones zigzag")
        add("--adaptive-cp-threshold", type=int, default=d["adaptive_cp_threshold"],
            help="new tokens from which adaptive CP splits a request (default: from the cost model)")
        add("--speculative-aux-hidden-layers", type=int, nargs="+", default=d["speculative_aux_hidden_layers"],
            help="layer ids whose incoming residual stream prefill returns (out.aux_hidden_states), e.g. 1 5 9")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> "EngineArgs":
        parser = _RaisingParser(prog="graphcp")
        cls.add_cli_args(parser)
        return cls.from_namespace(parser.parse_args(list(argv)))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``--dtype``: auto is bf16 on CUDA, fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[name]


def check_model_fits(args: EngineArgs, cfg) -> None:
    """The flags that depend on the model, checked before any allocation."""
    atp, kv = args.attn_tp_size, cfg.num_key_value_heads
    what = f"--tp: attention TP size {atp} (tp / (dp x attn-cp-size))"
    if atp > kv and set(cfg.attention_kinds) <= {"gqa", "gated_deltanet"}:
        # more ranks than KV heads: each KV head on atp / kv ranks (SGLang's replication)
        if atp % kv or cfg.num_attention_heads % atp:
            raise ConfigError(f"{what} must be a multiple of num_key_value_heads={kv} and divide "
                              f"num_attention_heads={cfg.num_attention_heads}")
        if args.disaggregation_mode == "prefill":
            raise ConfigError(f"{what} replicates the model's {kv} KV heads, which graphcp's PD "
                              f"transfer does not send; use an attention TP size <= {kv}")
    elif kv % atp:
        raise ConfigError(f"{what} must divide num_key_value_heads={kv}")
    if args.pp_size > cfg.num_hidden_layers:
        raise ConfigError(f"--pp {args.pp_size} exceeds the model's {cfg.num_hidden_layers} layers")
    bad = [i for i in args.speculative_aux_hidden_layers or () if i >= cfg.num_hidden_layers]
    if bad:
        raise ConfigError(f"--speculative-aux-hidden-layers: layer id {bad[0]} is out of range; the model "
                          f"has layers 0..{cfg.num_hidden_layers - 1}")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}     # one place for each default


class _RaisingParser(argparse.ArgumentParser):
    """argparse exits the process on bad flags; a library must raise instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"bad flags: {message}")


def is_gguf(model_path: str) -> bool:
    return model_path.endswith(".gguf")


def check_gguf_file(model_path: str) -> None:
    """The cheap check EngineArgs makes: an existing file that starts with the GGUF magic."""
    if not os.path.isfile(model_path):
        raise ConfigError(f"--model-path {model_path!r}: no such GGUF file")
    with open(model_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"--model-path {model_path!r} is not a GGUF file (no GGUF magic bytes)")


def _check_hf_dir(path: str) -> None:
    """config.json only: ``graphcp memory`` plans from it alone (the engine checks the weights
    before any rank starts: ``check_weights``)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model-path {path!r} has no config.json")


def check_weights(path: str) -> None:
    """An HF checkpoint directory holds safetensors weights (never a pickle)."""
    if is_gguf(path):
        return
    files = os.listdir(path)
    if not any(f.endswith(".safetensors") for f in files):
        pickled = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = f" (found {pickled[0]}: pickle checkpoints are never loaded; convert to safetensors)" if pickled else ""
        raise ConfigError(f"--model-path {path!r} has no *.safetensors weights{hint}")


def _check_aux_layers(layers: tuple | None) -> None:
    """Layer ids before the model is known: integers >= 0, each once (the range is checked at start)."""
    if layers is None:
        return
    flag = "--speculative-aux-hidden-layers"
    if not layers:
        raise ConfigError(f"{flag} needs at least one layer id (leave it unset for none)")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        raise ConfigError(f"{flag} must be layer ids (integers >= 0), got {list(layers)}")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{flag} lists a layer id twice: {list(layers)}")


def _choice(flag: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(choices)}")
