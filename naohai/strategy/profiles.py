"""Device profiles for the planner: memory, peak FLOPS and the link topology.

A profile describes its links as nested groups, innermost first: e.g. on an
Atlas 800 (Ascend 910A) training server four cards share an HCCS full mesh, the
two four-card groups of a node talk over PCIe, and nodes over RoCE.  A
collective over a group of ranks that spans ``n`` consecutive devices runs at
the speed of the smallest link group holding ``n`` devices (a ring is as fast as
its slowest hop); :meth:`DeviceProfile.link_for` returns it and the plan names it.

Built-in figures are ASSUMPTIONS from public product descriptions, not
measurements; every profile carries a ``source`` line saying so.  Users can give
their own with ``naohai plan --profile FILE``: a YAML mapping of the fields of
:class:`DeviceProfile` (optionally ``base: <built-in name>`` to start from one),
``links`` as a list of ``{name, group, gbs}`` with the last link having no
``group`` (it reaches every device).  Every value is checked by
:mod:`naohai.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

from naohai import validate
from naohai.config import read_yaml
from naohai.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Link:
    name: str                        # hccs | pcie | roce | ...
    group: Optional[int]             # devices this link connects (consecutive ranks); None = all
    gbs: float                       # GB/s per device for a ring collective over this link

    def describe(self) -> str:
        return f"{self.name} ({'<= ' + str(self.group) + ' devices' if self.group else 'between nodes'}, " \
               f"{self.gbs:g} GB/s)"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gb: float                 # device memory (HBM), GiB
    reserve_gb: float                # kept free for the runtime, workspace and fragmentation
    peak_tflops_16: float            # fp16/bf16 dense peak
    peak_tflops_32: float            # fp32 peak
    links: Tuple[Link, ...]          # innermost first; the last one has group None
    devices_per_node: int
    matmul_efficiency: float = 0.5   # sustained fraction of peak for the big matmuls
    dp_overlap: float = 0.5          # fraction of the data-parallel gradient sync hidden by compute
    source: str = ""

    def peak_tflops(self, compute_dtype: str) -> float:
        return self.peak_tflops_32 if compute_dtype == "float32" else self.peak_tflops_16

    def link_for(self, span_devices: int) -> Link:
        """The link a collective over ``span_devices`` consecutive devices is limited by."""
        for link in self.links:
            if link.group is None or span_devices <= link.group:
                return link
        return self.links[-1]


PROFILES: Dict[str, DeviceProfile] = {
    "ascend-910a-32g": DeviceProfile(
        name="ascend-910a-32g", memory_gb=32.0, reserve_gb=3.0, peak_tflops_16=256.0, peak_tflops_32=128.0,
        links=(Link("hccs", 4, 90.0), Link("pcie", 8, 16.0), Link("roce", None, 12.5)),
        devices_per_node=8, matmul_efficiency=0.3,
        source="assumed: 256 TFLOPS fp16 (Huawei Ascend 910 announcement / PanGu-alpha paper), fp32 taken as half; "
               "32 GB HBM; Atlas 800 node = two 4-card groups, HCCS full mesh inside a group (3 links x 30 GB/s), "
               "the groups joined over PCIe (16 GB/s per card assumed for a ring crossing it); one 100GE RoCE "
               "port per card (12.5 GB/s) between nodes. Matmul efficiency 0.3 roughly calibrated on the "
               "MindFormers PanGu-alpha 2.6B figure (4075 tokens/s/card). Not measured."),
    "ascend-910b-64g": DeviceProfile(
        name="ascend-910b-64g", memory_gb=64.0, reserve_gb=4.0, peak_tflops_16=313.0, peak_tflops_32=78.0,
        links=(Link("hccs", 8, 196.0), Link("roce", None, 25.0)),
        devices_per_node=8, matmul_efficiency=0.6,
        source="assumed: ~313 TFLOPS fp16 (Ascend 910B3 class), fp32 a quarter; 64 GB HBM; HCCS full mesh in an "
               "Atlas 800T A2 node (7 links x 56 GB/s, half usable per ring direction -> 196 GB/s); one 200GE "
               "RoCE port per card (25 GB/s). Matmul efficiency 0.6 from the MindFormers Llama2-7B figure (4160 "
               "tokens/s/NPU ~ 62% MFU). Not measured."),
}
DEFAULT_PROFILE = "ascend-910a-32g"

_OPTIONAL = ("matmul_efficiency", "dp_overlap", "source")


def _links(raw, where: str) -> Tuple[Link, ...]:
    if not isinstance(raw, list) or not raw:
        raise UserError(f"must be a non-empty list of {{name, group, gbs}}, innermost first, got {raw!r}",
                        where=where, key="links", rule="links form")
    out, last_group = [], 0
    for i, item in enumerate(raw):
        key = f"links[{i}]"
        item = validate.mapping(item, where, key)
        validate.known_keys(item, ("name", "group", "gbs"), where, key)
        name = validate.string(item.get("name", f"link{i}"), where, f"{key}.name")
        gbs = validate.number(item.get("gbs"), where, f"{key}.gbs", above=0, maximum=1e6)
        last = i == len(raw) - 1
        group = item.get("group")
        if group is None and not last:
            raise UserError("only the last link may leave out 'group' (it reaches every device)", where=where,
                            key=f"{key}.group", rule="inner links name their group size")
        if group is not None:
            group = validate.integer(group, where, f"{key}.group", last_group + 1, validate.MAX_DEVICES)
            last_group = group
        out.append(Link(name, group, gbs))
    if out[-1].group is not None:
        out.append(Link("beyond", None, out[-1].gbs))
    return tuple(out)


#: the smallest peak (TFLOP/s) and sustained fraction of it a profile may state: 1 GFLOP/s is slower than one
#: CPU core, 0.1% of peak below any matmul; the planner divides FLOPs by peak x efficiency, and 1e-300 x 1e-300
#: underflowed to 0 (a ZeroDivisionError)
MIN_PEAK_TFLOPS = 1e-3
MIN_MATMUL_EFFICIENCY = 1e-3


def check_profile(merged: Dict, where: str) -> DeviceProfile:
    """Validate a profile mapping (every number finite and in range) and build it."""
    v = validate
    mem = v.number(merged["memory_gb"], where, "memory_gb", above=0, maximum=1e6)
    reserve = v.number(merged["reserve_gb"], where, "reserve_gb", minimum=0, below=mem)
    links = merged["links"] if isinstance(merged["links"], tuple) else _links(merged["links"], where)
    return DeviceProfile(
        name=v.string(merged["name"], where, "name"), memory_gb=mem, reserve_gb=reserve,
        peak_tflops_16=v.number(merged["peak_tflops_16"], where, "peak_tflops_16", minimum=MIN_PEAK_TFLOPS,
                                maximum=1e6),
        peak_tflops_32=v.number(merged["peak_tflops_32"], where, "peak_tflops_32", minimum=MIN_PEAK_TFLOPS,
                                maximum=1e6),
        links=links,
        devices_per_node=v.integer(merged["devices_per_node"], where, "devices_per_node", 1, v.MAX_DEVICES),
        matmul_efficiency=v.number(merged.get("matmul_efficiency", 0.5), where, "matmul_efficiency",
                                   minimum=MIN_MATMUL_EFFICIENCY, maximum=1),
        dp_overlap=v.number(merged.get("dp_overlap", 0.5), where, "dp_overlap", minimum=0, maximum=1),
        source=v.string(merged.get("source", f"user profile {where}"), where, "source"))


def recipe_profile(name: Optional[str], where: str) -> Optional[DeviceProfile]:
    """The profile a recipe's ``train.device_profile`` names (None: left out), checked when the run is planned:
    the trainer reads it at the first logged step on Ascend and GPU, after the data is prepared and the model
    built, and a mistake then was blamed on ``--profile``."""
    if name is None:
        return None
    key = "train.device_profile"
    try:
        return load_profile(name, where=where, key=key)
    except UserError as err:
        if err.key == key:         # the name itself: no built-in profile and no YAML file
            raise
        # the YAML profile's own error names its file and key; say which recipe key pointed there
        told = ": ".join(str(x) for x in (err.where, err.key and f"key '{err.key}'", err.message) if x)
        raise UserError(f"names a device profile that does not load: {told}", where=where, key=key,
                        rule=err.rule or "a built-in profile or a YAML profile that loads") from None


def load_profile(name_or_path: str, where: str = "command line", key: str = "--profile") -> DeviceProfile:
    """A built-in profile by name, or a YAML file with the DeviceProfile fields; an unknown name is refused as
    ``key`` of ``where`` (the flag or recipe key that gave it)."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if not name_or_path.endswith((".yaml", ".yml")):
        raise UserError(f"unknown device profile '{name_or_path}'.{did_you_mean(name_or_path, PROFILES)} "
                        f"Built-in: {', '.join(PROFILES)}; or give a YAML file.", where=where,
                        key=key, rule="known profile")
    raw = read_yaml(name_or_path, "device profile")
    names = [f.name for f in fields(DeviceProfile)]
    validate.known_keys(raw, ["base", *names], name_or_path)
    base = {}
    if "base" in raw:
        base = dict(PROFILES[validate.choice(raw["base"], PROFILES, name_or_path, "base")].__dict__)
    raw = {k: v for k, v in raw.items() if k != "base"}
    merged = {**base, **raw}
    merged.setdefault("name", name_or_path)
    merged.setdefault("source", f"user profile {name_or_path}")
    missing = [n for n in names if n not in merged and n not in _OPTIONAL]
    if missing:
        raise UserError(f"missing keys: {', '.join(missing)} (or set base: {DEFAULT_PROFILE})",
                        where=name_or_path, key=missing[0], rule="required keys")
    return check_profile(merged, name_or_path)
