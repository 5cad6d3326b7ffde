"""Weights as released: FP8 stays FP8 and nothing is staged at load, on shrunk twins of the
released configs (DeepSeek-V3 with its 256 experts, Qwen3-MoE FP8), written as the releases are
(sharded safetensors and index, FP8 projections with their block scales, the rest in the model
dtype). Resident weights against the checkpoint's own bytes, the load's peak memory, and
``graphcp memory`` (config.json alone) against what a real load holds per rank and what a real
engine sizes its pool to."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from testkit.fp8_checkpoint import make_fp8_checkpoint
from testkit.hf_reference import make_checkpoint
from testkit.mla_checkpoint import DEEPSEEK_V3, write_release

from graphcp import Engine, EngineArgs
from graphcp.checkpoint.config import read_model_config
from graphcp.checkpoint.loader import load_model
from graphcp.checkpoint.meta import checkpoint_tensors
from graphcp.distributed.parallel import rank_shards
from graphcp.memory import memory_report

# DeepSeek-V3 as released but smaller: all 256 routed experts with top-8 in 8 groups, 3 dense
# layers then MoE, MLA with a query LoRA, YaRN; widths shrunk.
V3_SIZES = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=32, max_position_embeddings=8192,
                rope_scaling={**DEEPSEEK_V3["rope_scaling"], "factor": 2})  # 8K positions, not 160K
RATIO = 1.10            # resident weights / the checkpoint's own bytes


def _to_dtype(path: str, dtype: torch.dtype) -> None:
    """Every unquantized tensor in ``dtype`` (FP8 weights and their fp32 scales as they are)."""
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        tensors = load_file(file)
        out = {k: (v if v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv") else v.to(dtype))
               for k, v in tensors.items()}
        save_file(out, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def twins(ckpt_dir):
    """name -> {dtype: checkpoint dir}: each release-shaped FP8 twin in fp32 and in bf16."""
    out = {}
    v3, _ = write_release(str(ckpt_dir / "mem-v3"), DEEPSEEK_V3, seed=41, **V3_SIZES)
    src = make_checkpoint(str(ckpt_dir / "mem-qwen-src"), "qwen3_moe", seed=42, hidden_size=128,
                          num_hidden_layers=2, intermediate_size=256, moe_intermediate_size=64,
                          num_experts=32, num_experts_per_tok=4, head_dim=32, vocab_size=512)
    qwen, _ = make_fp8_checkpoint(src, str(ckpt_dir / "mem-qwen"), str(ckpt_dir / "mem-qwen-deq"),
                                  (32, 32), ("lm_head", "model.layers.0.mlp.gate",
                                             "model.layers.1.mlp.gate"))
    for name, path in (("deepseek_v3", v3), ("qwen3_moe", qwen)):
        bf16 = str(ckpt_dir / f"mem-{name}-bf16")
        shutil.copytree(path, bf16)
        _to_dtype(bf16, torch.bfloat16)
        out[name] = {torch.float32: path, torch.bfloat16: bf16}
    return out


def _checkpoint_bytes(path: str) -> int:
    """Bytes of the checkpoint tensors the model loads (not the MTP layer it skips)."""
    cfg = read_model_config(path)
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    expected, quantized = checkpoint_tensors(cfg, None)
    wanted = set(expected) | {f"{n}_scale_inv" for n in quantized}
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in wanted:
                    t = f.get_slice(name)
                    numel = torch.Size(t.get_shape()).numel()
                    total += numel * {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
    return total


def _resident(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_resident_weights_are_the_checkpoints_bytes(twins, name, dtype):
    """At one rank the weights take at most 1.10x the checkpoint's bytes: FP8 experts and
    projections stay FP8, only MLA's kv_b_proj is dequantized, routers stay fp32."""
    path = twins[name][dtype]
    model = load_model(path, dtype, torch.device("cpu"))
    sd = model.state_dict()
    fp8 = sum(t.numel() for t in sd.values() if t.dtype == torch.float8_e4m3fn)
    assert fp8 > 0.5 * sum(t.numel() for t in sd.values()), "most weights stay FP8"
    ratio = _resident(model) / _checkpoint_bytes(path)
    print(f"{name} {dtype}: resident / checkpoint = {ratio:.3f}")
    assert 0.99 <= ratio <= RATIO


LAYOUTS = {
    "tp1": {},
    "tp2_ep2": dict(tp_size=2, ep_size=2),
    "tp4_ep4_cp2": dict(tp_size=4, ep_size=4, attn_cp_size=2, enable_prefill_cp=True,
                        cp_strategy="zigzag"),
    "tp2_expert_tp2_pp2": dict(tp_size=2, pp_size=2),
}


@pytest.mark.parametrize("name,layout", [(n, lay) for n in ("deepseek_v3", "qwen3_moe")
                                         for lay in LAYOUTS
                                         if not (n == "deepseek_v3" and "pp" in lay)])  # MLA: pp 1
def test_memory_plan_is_what_each_rank_loads(twins, tmp_path, name, layout):
    """``graphcp memory`` from config.json alone: each rank's weight bytes (by dtype) equal what
    that rank's load holds, within 2% (the same meta build: exactly)."""
    path = twins[name][torch.bfloat16]
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(os.path.join(path, "config.json"), config_only / "config.json")
    args = EngineArgs(model_path=str(config_only), dtype="bfloat16", **LAYOUTS[layout])
    report = memory_report(args, "cuda", 141)
    assert report.fits, report.problem
    cfg = read_model_config(path)
    for rank in report.ranks:
        s = rank_shards(args, cfg, rank.rank)
        model = load_model(path, torch.bfloat16, torch.device("cpu"), s.attn_tp, s.layers,
                           s.ffn_tp, s.ep)
        held = _resident(model)
        assert abs(rank.weight_bytes - held) <= 0.02 * held, (rank.rank, rank.weight_bytes, held)
        by_dtype = {}
        for t in model.state_dict().values():
            key = str(t.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
        assert rank.weight_bytes_by_dtype == by_dtype


def test_engine_pool_and_weights_are_the_plan(twins):
    """A real engine on CPU told the device's size sizes its pool exactly as the plan does, and
    reports the plan's weight bytes as resident."""
    path = twins["qwen3_moe"][torch.float32]
    args = EngineArgs(model_path=path, gpu_memory_gib=0.125, mem_fraction_static=0.5,
                      disable_cuda_graph=True)
    report = memory_report(args, "cpu", args.gpu_memory_gib)
    with Engine(args) as engine:
        stats = engine.stats()
    assert stats["kv_tokens_total"] == report.ranks[0].max_total_tokens > 0
    assert stats["weight_bytes_per_rank"] == [report.ranks[0].weight_bytes]


def test_plan_says_what_does_not_fit(twins, tmp_path):
    path = twins["deepseek_v3"][torch.bfloat16]
    weights = memory_report(EngineArgs(model_path=path, dtype="bfloat16"), "cuda", 0.01)
    assert not weights.fits and "weights" in weights.problem and "exceed" in weights.problem
    args = EngineArgs(model_path=path, dtype="bfloat16", mem_fraction_static=0.6)
    rank = memory_report(args, "cuda", 1.0).ranks[0]
    # A device whose fraction leaves the pool 1000 tokens after the weights: less than a request.
    gib = (rank.weight_bytes + 1000.5 * rank.kv_bytes_per_token) / 0.6 / 2**30
    kv = memory_report(args, "cuda", gib)
    assert kv.ranks[0].max_total_tokens == 1000
    assert not kv.fits and "holds 1000 tokens per rank, less than one 4096-token request" in kv.problem
    out = subprocess.run([sys.executable, "-m", "graphcp", "memory", "--model-path", path,
                          "--device", "cuda", "--gpu-memory-gib", "0.01", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["fits"] is False and last["ranks"][0]["weight_bytes"] == weights.ranks[0].weight_bytes
    assert "does not fit: rank 0: weights" in out.stdout


_PEAK = """
import sys, torch
from graphcp.checkpoint.loader import load_model
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")      # reset the peak (VmHWM) to the current RSS
before, files = status("VmRSS"), status("RssFile")
model = load_model(sys.argv[1], torch.bfloat16, torch.device("cpu"))
# Library code pages first touched by the load stay mapped (file-backed, not data): off the peak.
peak = status("VmHWM") - (status("RssFile") - files)
resident = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(peak - before, resident)
"""


def test_load_peak_is_resident_plus_one_tensor(twins):
    """Parameters are created in their final dtype and filled one checkpoint tensor at a time: the
    load's peak RSS over the process before it is the resident weights plus the largest tensor
    being read (its file pages and its copy), within 8 MiB of allocator slack. A load that
    staged the model in fp32, or dequantized experts, would need 2-4x."""
    path = twins["deepseek_v3"][torch.bfloat16]
    largest = 0
    for file in (f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                largest = max(largest, t.numel() * 4)    # dequantized kv_b_proj reads in fp32
    out = subprocess.run([sys.executable, "-c", _PEAK, path], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    growth, resident = map(int, out.stdout.split())
    print(f"load peak growth {growth / 2**20:.1f} MiB, resident {resident / 2**20:.1f} MiB, "
          f"largest tensor {largest / 2**20:.2f} MiB")
    assert resident > 12 << 20, "the twin is big enough for the bound to mean something"
    assert growth <= resident + 2 * largest + (8 << 20)
