"""Deadlock checks on the compiled IR of every rank of a simulated-device compile.

"Every rank compiled" does not mean the step runs: a pipeline step can compile on every
rank and still wait forever on hardware.  This module reads each rank's validate-pass
IR (``rank_<r>/<graph>.ir``, written by :mod:`naohai.simulate.worker`) and checks, per
graph, the invariants a step needs to make progress:

1. **point to point**: for every ordered pair of ranks, the ``Send`` ops of one towards
   the other and the ``Receive`` ops of the other from the first agree (same count per
   ``sr_tag`` and shape);
2. **collectives**: every member of a communication group issues the same sequence of
   collective ops (kind, reduction, shape) on that group;
3. **global norm** (when the train step clips gradients and has pipeline stages): every
   rank takes part in the cross-stage ``AllReduce`` MindSpore inserts for the squared
   gradient norm (instance name ``PARALLEL_GLOBALNORM_BETWEEN_STAGES``, a constant of
   MindSpore's ``frontend/parallel/ops_info/ops_utils.h``), over a group with a member on
   every stage;
4. **frozen weights** (fine-tuning, when the trainable parameters are named): no rank
   reduces a gradient of any other parameter.  MindSpore tags the ``AllReduce`` /
   ``ReduceScatter`` of a parameter's gradient with the parameter's name
   (``mirror_user_id``); frozen weights (``requires_grad=False``) have no gradient, so none
   may appear (their optimizer-parallel forward ``AllGather`` carries the tag too and is
   not a gradient reduction).
5. **token weight** (fine-tuning on SFT data, when the weight Parameter is named): the masked loss is
   normalised by the host-set ``sft.token_weight`` (``f / N``, N the learned tokens of the GLOBAL
   batch), not by anything computed per micro-batch: on every rank the reported ``loss`` is a ``Mul``
   by that Parameter's ``Load``, and so is the gradient seed ``sens`` wherever it exists -- on every
   last-stage rank, where the loss is computed (earlier stages have none: their gradients arrive as
   received activation gradients) (:class:`naohai.train.step.TrainStep`'s names).

:func:`check_irs` returns an :class:`IrCheck` (``passed``, messages such as "rank 0 waits
for 4 Receive from rank 4 that never sends", counts per rank) that ``naohai check
--compile`` prints and records in ``summary.json`` as ``ir_checks``.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

#: collective primitives whose members must agree on a group (point-to-point handled apart)
COLLECTIVES = frozenset({
    "AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "AllToAll", "AlltoAllV", "AllToAllv",
    "Broadcast", "Reduce", "Barrier", "NeighborExchange", "NeighborExchangeV2",
    "CollectiveScatter", "CollectiveGather",
})
_NODE_RE = re.compile(r"^\s*%\S+\s*=\s*(?:PrimFunc_)?([A-Za-z_][A-Za-z0-9_]*)\((.*)$")
_INSTANCE_RE = re.compile(r"\{instance name: ([^}]*)\}")
#: instance names MindSpore gives the all-reduces of the global norm (the square sums that
#: naohai.strategy.gradients.square_sum marks for the parallel passes)
GLOBALNORM_BETWEEN_STAGES = "PARALLEL_GLOBALNORM_BETWEEN_STAGES"
GLOBALNORM_IN_STAGES = "PARALLEL_GLOBALNORM_IN_STAGES"
_ATTRS_RE = re.compile(r"primitive_attrs: \{(.*?)\}\s*(?:cnode_attrs|cnode_primal_attrs|$)")


@dataclass(frozen=True)
class CommOp:
    kind: str
    group: str
    members: Tuple[int, ...]
    shape: Tuple[int, ...] = ()
    reduce: str = ""
    peer: Optional[int] = None    # Send: destination rank; Receive: source rank (global ids)
    tag: Optional[int] = None
    name: str = ""                # the node's instance name
    param: str = ""               # the parameter MindSpore tagged it with (mirror_user_id), if any


def _int_attr(attrs: str, key: str) -> Optional[int]:
    m = re.search(rf"\b{key}: I64\((-?\d+)\)", attrs)
    return int(m.group(1)) if m else None


def _tuple_attr(attrs: str, key: str) -> Tuple[int, ...]:
    m = re.search(rf"\b{key}: [(\[]([-\d, ]*)[)\]]", attrs)
    if not m:
        return ()
    return tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)


def parse_comm_ops(ir_text: str) -> List[CommOp]:
    """Communication ops of one IR file, in the order they appear."""
    ops: List[CommOp] = []
    for line in ir_text.splitlines():
        m = _NODE_RE.match(line)
        if not m:
            continue
        kind = m.group(1)
        if kind not in COLLECTIVES and kind not in ("Send", "Receive"):
            continue
        am = _ATTRS_RE.search(line)
        attrs = am.group(1) if am else ""
        g = re.search(r'\bgroup: "([^"]*)"', attrs)
        members = _tuple_attr(attrs, "group_rank_ids")
        shape = _tuple_attr(attrs, "shape")
        red = re.search(r'\bop: "([^"]*)"', attrs)
        peer_key = "dest_rank" if kind == "Send" else "src_rank"
        peer = _int_attr(attrs, peer_key) if kind in ("Send", "Receive") else None
        if peer is not None and members and 0 <= peer < len(members):
            peer = members[peer]  # rank within the group -> global rank
        inst = _INSTANCE_RE.search(line)
        user = re.search(r'\bmirror_user_id: "([^"]*)"', line)
        ops.append(CommOp(kind, g.group(1) if g else "", members, shape,
                          red.group(1) if red else "", peer,
                          _int_attr(attrs, "sr_tag"), inst.group(1).strip() if inst else "",
                          user.group(1) if user else ""))
    return ops


@dataclass
class IrCheck:
    graph: str
    passed: bool
    messages: List[str] = field(default_factory=list)
    per_rank: Dict[int, Dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> Dict:
        return {"graph": self.graph, "passed": self.passed, "messages": self.messages,
                "per_rank": {str(r): c for r, c in sorted(self.per_rank.items())}}


def _fmt_ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def check_point_to_point(ops: Dict[int, List[CommOp]]) -> List[str]:
    """Every Receive has its Send on the peer, and vice versa (count per tag and shape), for every
    pair of ranks whose IR is in ``ops`` (a compile of chosen ranks checks the pairs it holds)."""
    sends: Dict[Tuple[int, int], Counter] = defaultdict(Counter)
    recvs: Dict[Tuple[int, int], Counter] = defaultdict(Counter)
    for rank, rank_ops in ops.items():
        for op in rank_ops:
            if op.kind == "Send":
                sends[(rank, op.peer)][(op.tag, op.shape)] += 1
            elif op.kind == "Receive":
                recvs[(op.peer, rank)][(op.tag, op.shape)] += 1
    messages = []
    for pair in sorted(set(sends) | set(recvs), key=lambda p: (p[0] if p[0] is not None else -1,
                                                               p[1] if p[1] is not None else -1)):
        src, dst = pair
        if src not in ops or dst not in ops:
            continue
        s, r = sends.get(pair, Counter()), recvs.get(pair, Counter())
        if s == r:
            continue
        n_s, n_r = sum(s.values()), sum(r.values())
        if n_s == 0:
            messages.append(f"rank {dst} waits for {n_r} Receive from rank {src} that never sends")
        elif n_r == 0:
            messages.append(f"rank {src} issues {n_s} Send to rank {dst} that never receives")
        else:
            missing = r - s
            extra = s - r
            messages.append(f"rank {src} -> rank {dst}: {n_s} Send vs {n_r} Receive; unmatched receives "
                            f"(tag, shape) {sorted(missing.items())}, unmatched sends {sorted(extra.items())}")
    return messages


def check_collectives(ops: Dict[int, List[CommOp]]) -> List[str]:
    """Every member of a group issues the same sequence of collectives on it."""
    by_group: Dict[Tuple[str, Tuple[int, ...]], Dict[int, List[Tuple]]] = defaultdict(dict)
    for rank, rank_ops in ops.items():
        for op in rank_ops:
            if op.kind in COLLECTIVES:
                key = (op.group, op.members)
                by_group[key].setdefault(rank, []).append((op.kind, op.reduce, op.shape))
    messages = []
    for (group, members), seqs in sorted(by_group.items()):
        expected = [m for m in members if m in ops] or sorted(seqs)
        absent = [m for m in expected if m not in seqs]
        variants: Dict[Tuple, List[int]] = defaultdict(list)
        for m in expected:
            variants[tuple(seqs.get(m, ()))].append(m)
        if len(variants) <= 1:
            continue
        counts = {m: len(seqs.get(m, ())) for m in expected}
        detail = "; ".join(f"{_fmt_ranks(ms)}: {len(seq)} ops" + (f" ({_summary(seq)})" if seq else "")
                           for seq, ms in sorted(variants.items(), key=lambda kv: kv[1]))
        what = (f"{_fmt_ranks(absent)} never join{'s' if len(absent) == 1 else ''}"
                if absent else "members disagree")
        if not absent and len(set(counts.values())) == 1:
            what = "members issue the same number of collectives in a different order or shape"
        messages.append(f"group {group} {list(members)}: {what}: {detail}")
    return messages


def _summary(seq: Sequence[Tuple]) -> str:
    c = Counter(kind for kind, _, _ in seq)
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items()))


def check_global_norm(ops: Dict[int, List[CommOp]], stages: int, world: int) -> List[str]:
    """Every rank joins the global-norm AllReduce between stages, over a group on every stage."""
    per_stage = world // stages
    missing = []
    for rank, rank_ops in sorted(ops.items()):
        spans = any(op.kind == "AllReduce" and op.name == GLOBALNORM_BETWEEN_STAGES
                    and len({m // per_stage for m in op.members}) == stages for op in rank_ops)
        if not spans:
            missing.append(rank)
    if not missing:
        return []
    return [f"{_fmt_ranks(missing)} take{'s' if len(missing) == 1 else ''} no part in the global-norm "
            f"AllReduce between stages ({GLOBALNORM_BETWEEN_STAGES}): the gradient norm would cover only "
            f"its own stage, so stages could clip and skip differently"]


#: the collectives that reduce a gradient (a parameter-tagged AllGather is a forward weight gather)
GRADIENT_REDUCTIONS = ("AllReduce", "ReduceScatter")


def reduced_gradients(rank_ops: Sequence[CommOp]) -> Counter:
    """Parameter name -> how many gradient reductions of it one rank's graph holds."""
    return Counter(op.param for op in rank_ops if op.param and op.kind in GRADIENT_REDUCTIONS)


def check_frozen(ops: Dict[int, List[CommOp]], trainable: Sequence[str]) -> List[str]:
    """A message for every rank that reduces the gradient of a parameter not in ``trainable``."""
    keep = set(trainable)
    messages = []
    for r, rank_ops in sorted(ops.items()):
        frozen = sorted(p for p in reduced_gradients(rank_ops) if p not in keep)
        if frozen:
            messages.append(f"rank {r} reduces the gradient of {len(frozen)} frozen parameter(s), e.g. "
                            f"{', '.join(frozen[:3])}")
    return messages


_LOAD_RE = r"^\s*(%\d+)\([^)]*\)\s*=\s*(?:PrimFunc_)?Load\(%para\d+_{name}\b"


def weighted_nodes(ir_text: str, weight: str) -> List[str]:
    """Names of the ``Mul`` nodes of one rank's IR that take the ``Load`` of Parameter ``weight``."""
    loads = re.findall(_LOAD_RE.format(name=re.escape(weight)), ir_text, flags=re.M)
    if not loads:
        return []
    uses = re.compile(r"^\s*%\d+\(([^)]*)\)\s*=\s*(?:PrimFunc_)?Mul\(([^)]*)\)", re.M)
    mine = set(loads)
    return [m.group(1) for m in uses.finditer(ir_text) if mine & {a.strip() for a in m.group(2).split(",")}]


def check_token_weight(texts: Dict[int, str], weight: str, stages: int, world: int) -> List[str]:
    """Check 5 of the module docstring for one train graph, ``{rank: IR text}``."""
    per_stage = max(1, world // max(1, stages))
    messages = []
    for r, text in sorted(texts.items()):
        names = weighted_nodes(text, weight)
        last = r // per_stage == stages - 1
        need = ["loss"] + (["sens"] if last or re.search(r"^\s*%\d+\(sens\)\s*=", text, flags=re.M) else [])
        missing = [n for n in need if n not in names]
        if missing:
            messages.append(f"rank {r}: {' and '.join(missing)} not multiplied by the token weight '{weight}' "
                            f"(the masked loss must be normalised by the global batch's learned tokens)")
    return messages


def check_irs(ir_files: Dict[int, Path], graph: str, *, stages: int = 1, world: Optional[int] = None,
              needs_global_norm: bool = False, trainable: Optional[Sequence[str]] = None,
              token_weight: Optional[str] = None) -> IrCheck:
    """Run the checks on one graph's IR, given ``{rank: path}`` for every rank; ``trainable`` (the
    names of the only parameters that train, for a fine-tuning run) adds the frozen-weight check,
    ``token_weight`` (the masked loss's weight Parameter; a train graph) the token-weight check."""
    world = world or len(ir_files)
    texts = {r: Path(p).read_text(errors="replace") for r, p in ir_files.items()}
    ops = {r: parse_comm_ops(text) for r, text in texts.items()}
    messages = check_point_to_point(ops) + check_collectives(ops)
    if token_weight is not None:
        messages += check_token_weight(texts, token_weight, stages, world)
    if needs_global_norm and stages > 1:
        messages += check_global_norm(ops, stages, world)
    if trainable is not None:
        messages += check_frozen(ops, trainable)
    per_rank = {}
    for r, rank_ops in ops.items():
        c = Counter(op.kind for op in rank_ops)
        per_rank[r] = {"Send": c.get("Send", 0), "Receive": c.get("Receive", 0),
                       "collectives": sum(n for k, n in c.items() if k in COLLECTIVES),
                       "global_norm": sum(1 for op in rank_ops if op.name in (GLOBALNORM_BETWEEN_STAGES,
                                                                           GLOBALNORM_IN_STAGES)),
                       "reduced_params": len(reduced_gradients(rank_ops))}
    return IrCheck(graph, not messages, messages, per_rank)


def check_compile_dir(workdir: Path, ranks: int, graphs: Sequence[str], *, stages: int = 1,
                      clip: bool = False, only: Optional[Sequence[int]] = None,
                      trainable: Optional[Sequence[str]] = None, token_weight: Optional[str] = None) -> Dict:
    """Check every graph of a compile job's ``rank_<r>/<graph>.ir``; the ``ir_checks`` record.

    ``ranks`` is the world size; ``only`` the ranks that were compiled when not all were: then
    Send/Receive are matched between the compiled ranks (pipeline neighbours at the same data /
    model position), collectives among the compiled members of each group, and every compiled
    rank must join the global-norm reduction across all stages.  ``trainable``, ``token_weight`` (checked in
    the one-graph train step): see :func:`check_irs`."""
    workdir = Path(workdir)
    results = []
    for graph in graphs:
        files = {r: workdir / f"rank_{r}" / f"{graph}.ir" for r in (only if only is not None else range(ranks))}
        absent = [r for r, p in files.items() if not p.exists()]
        if absent:
            results.append(IrCheck(graph, False, [f"no IR for graph '{graph}' on {_fmt_ranks(absent)}"]))
            continue
        results.append(check_irs(files, graph, stages=stages, world=ranks,
                                 needs_global_norm=clip and graph in ("train", "apply"), trainable=trainable,
                                 token_weight=token_weight if graph == "train" else None))
    return {"passed": all(r.passed for r in results) and bool(results),
            "graphs": [r.to_dict() for r in results],
            "trainable": None if trainable is None else len(trainable), "token_weight": token_weight}


def render(record: Dict) -> str:
    """Lines for the terminal."""
    lines = []
    for g in record.get("graphs", []):
        counts = g["per_rank"]
        sends = sum(c["Send"] for c in counts.values())
        recvs = sum(c["Receive"] for c in counts.values())
        coll = sum(c["collectives"] for c in counts.values())
        lines.append(f"IR checks, graph {g['graph']}: {'passed' if g['passed'] else 'FAILED'} "
                     f"({sends} Send / {recvs} Receive, {coll} collectives over {len(counts)} ranks)")
        lines.extend(f"  - {m}" for m in g["messages"][:20])
        if record.get("trainable") is not None and g["graph"] != "eval":
            most = max((c.get("reduced_params", 0) for c in counts.values()), default=0)
            lines.append(f"  frozen weights: gradients reduced for at most {most} parameters per rank, all of "
                         f"them among the {record['trainable']} trainable ones" if g["passed"] else
                         "  frozen weights: see above")
        if record.get("token_weight") and g["graph"] == "train" and g["passed"]:
            lines.append(f"  masked loss: every rank's loss and every last-stage gradient seed is multiplied by the "
                         f"host-set token weight '{record['token_weight']}' (1 / the global batch's learned tokens)")
    return "\n".join(lines)
