"""Device profiles for the planner: memory, peak FLOPS, link bandwidths.

Built-in figures are ASSUMPTIONS from public product descriptions, not
measurements; every profile carries a ``source`` line saying so.  Users can give
their own with ``naohai plan --profile FILE`` (a YAML mapping of the fields of
:class:`DeviceProfile`; unknown keys are errors).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict

from naohai.config import read_yaml
from naohai.errors import UserError, did_you_mean


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gb: float                 # device memory (HBM), GiB
    reserve_gb: float                # kept free for the runtime, workspace and fragmentation
    peak_tflops_16: float            # fp16/bf16 dense peak
    peak_tflops_32: float            # fp32 peak
    intra_node_gbs: float            # GB/s per device for collectives inside a node
    inter_node_gbs: float            # GB/s per device across nodes
    devices_per_node: int
    matmul_efficiency: float = 0.5   # sustained fraction of peak for the big matmuls
    dp_overlap: float = 0.5          # fraction of the data-parallel gradient sync hidden by compute
    source: str = ""

    def peak_tflops(self, compute_dtype: str) -> float:
        return self.peak_tflops_32 if compute_dtype == "float32" else self.peak_tflops_16


PROFILES: Dict[str, DeviceProfile] = {
    "ascend-910a-32g": DeviceProfile(
        name="ascend-910a-32g", memory_gb=32.0, reserve_gb=3.0, peak_tflops_16=256.0, peak_tflops_32=128.0,
        intra_node_gbs=90.0, inter_node_gbs=12.5, devices_per_node=8, matmul_efficiency=0.3,
        source="assumed: 256 TFLOPS fp16 (Huawei Ascend 910 announcement / PanGu-alpha paper), fp32 taken as half; "
               "32 GB HBM; HCCS 3 links x 30 GB/s inside a 4-card group of an Atlas 800 node; one 100GE RoCE port "
               "per card (12.5 GB/s) between nodes. Matmul efficiency 0.3 roughly calibrated on the MindFormers PanGu-alpha "
               "2.6B figure (4075 tokens/s/card). Not measured."),
    "ascend-910b-64g": DeviceProfile(
        name="ascend-910b-64g", memory_gb=64.0, reserve_gb=4.0, peak_tflops_16=313.0, peak_tflops_32=78.0,
        intra_node_gbs=196.0, inter_node_gbs=25.0, devices_per_node=8, matmul_efficiency=0.6,
        source="assumed: ~313 TFLOPS fp16 (Ascend 910B3 class), fp32 a quarter; 64 GB HBM; HCCS full mesh in an "
               "Atlas 800T A2 node (7 links x 56 GB/s, half usable per ring direction -> 196 GB/s); one 200GE "
               "RoCE port per card (25 GB/s). Matmul efficiency 0.6 from the MindFormers Llama2-7B figure (4160 "
               "tokens/s/NPU ~ 62% MFU). Not measured."),
}
DEFAULT_PROFILE = "ascend-910a-32g"


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in profile by name, or a YAML file with the DeviceProfile fields."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if not name_or_path.endswith((".yaml", ".yml")):
        raise UserError(f"unknown device profile '{name_or_path}'.{did_you_mean(name_or_path, PROFILES)} "
                        f"Built-in: {', '.join(PROFILES)}; or give a YAML file.", where="command line",
                        key="--profile", rule="known profile")
    raw = read_yaml(name_or_path, "device profile")
    names = [f.name for f in fields(DeviceProfile)]
    base = dict(PROFILES[raw["base"]].__dict__) if raw.get("base") in PROFILES else {}
    raw = {k: v for k, v in raw.items() if k != "base"}
    for k in raw:
        if k not in names:
            raise UserError(f"unknown key '{k}'.{did_you_mean(k, names)} Known keys: base, {', '.join(names)}.",
                            where=name_or_path, key=str(k), rule="known keys")
    merged = {**base, **raw}
    merged.setdefault("name", name_or_path)
    merged.setdefault("source", f"user profile {name_or_path}")
    missing = [n for n in names if n not in merged and n not in ("matmul_efficiency", "dp_overlap", "source")]
    if missing:
        raise UserError(f"missing keys: {', '.join(missing)} (or set base: {DEFAULT_PROFILE})",
                        where=name_or_path, key=missing[0], rule="required keys")
    for n in names:
        if n in ("name", "source"):
            continue
        v = merged[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise UserError(f"must be a number >= 0, got {v!r}", where=name_or_path, key=n, rule="type")
    if merged["memory_gb"] <= merged["reserve_gb"] or merged["devices_per_node"] < 1:
        raise UserError("memory_gb must exceed reserve_gb and devices_per_node be >= 1", where=name_or_path,
                        key="memory_gb", rule="memory_gb > reserve_gb")
    return DeviceProfile(**merged)
