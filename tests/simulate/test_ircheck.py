"""IR deadlock checks: Send/Receive pairing, collective sequences per group, the global norm.

The fast tests feed IR lines in the exact format MindSpore 2.10 prints (copied shapes of
lines from a validate-pass dump); the slow test compiles the pipeline wiring naohai
shipped before (``Pipeline`` + ``value_and_grad``) and asserts the check flags its
unmatched receives, while naohai's current step passes (test_check.py).
"""
from pathlib import Path

import pytest

from naohai.simulate.harness import run_compile
from naohai.simulate.ircheck import check_irs, parse_comm_ops

ROOT = Path(__file__).resolve().parents[2]
WORLD = "(0, 1, 2, 3, 4, 5, 6, 7)"


def send(i, dest, tag, shape="[256, 128]"):
    return (f'  %{i}(x) = Send(%{i - 1}) {{instance name: Send}} primitive_attrs: {{shape: {shape}, '
            f'dest_rank: I64({dest}), group: "nccl_world_group", group_rank_ids: {WORLD}, sr_tag: I64({tag}), '
            f'no_eliminate: Bool(1), dtype: F32}} cnode_attrs: {{checkpoint: Bool(1)}} '
            f'cnode_primal_attrs: {{dest_rank: I64(1), micro: I64({tag})}}')


def recv(i, src, tag, shape="[256, 128]"):
    return (f'  %{i}(dx) = Receive(%{i - 1}) primitive_attrs: {{shape: {shape}, group: "nccl_world_group", '
            f'group_rank_ids: {WORLD}, src_rank: I64({src}), sr_tag: I64({tag}), dtype: F32}} '
            f'cnode_attrs: {{checkpoint: Bool(1)}} cnode_primal_attrs: {{dest_rank: I64(1), micro: I64({tag})}}')


def allreduce(i, members, name="all_reduce", group=None):
    ids = "(" + ", ".join(map(str, members)) + ")"
    group = group or f"{len(members)}-{abs(hash(ids)) % 10**6}"
    return (f'  %{i}(y) = AllReduce(%{i - 1}) {{instance name: {name}}} primitive_attrs: {{comm_reuse: Bool(1), '
            f'group: "{group}", fusion: I64(0), op: "sum", rank_list: {ids}, group_rank_ids: {ids}, '
            f'no_eliminate: Bool(1)}} cnode_attrs: {{checkpoint: Bool(1)}}')


def grad_allreduce(i, param):
    """A parameter's gradient all-reduce as MindSpore 2.10 prints it (tagged with the parameter's name)."""
    return (f'  %{i}(real_grad) = AllReduce(%{i - 1}) {{instance name: grad_mirror_MirrorMicroStepOperator}} '
            f'primitive_attrs: {{group: "2-63", fusion: I64(1), op: "sum", no_eliminate: Bool(1), index: I64(0), '
            f'group_rank_ids: (0, 1)}} cnode_attrs: {{checkpoint: Bool(1)}} cnode_primal_attrs: '
            f'{{forward_node_name: "_MirrorMicroStepOperator_85731", forward_unique_id: "85731", '
            f'mirror_user_id: "{param}"}}')


def weight_allgather(i, param):
    """The optimizer-parallel forward gather of a weight: tagged too, but no gradient reduction."""
    return (f'  %{i}(w) = AllGather(%para6_{param}) {{instance name: parallel_optimizer_allgather_not_recompute}} '
            f'primitive_attrs: {{with_mirror_operator: Bool(0), group: "2-52", fusion: I64(1), group_ranks: "0-1", '
            f'recompute: Bool(0), group_rank_ids: (0, 1), mirror_user_id: "{param}"}}')


def write(tmp_path, texts):
    files = {}
    for r, lines in texts.items():
        files[r] = tmp_path / f"{r}.ir"
        files[r].write_text("\n".join(lines) + "\n")
    return files


def test_parse_reads_peer_tag_shape_and_group():
    ops = parse_comm_ops("\n".join([send(1, 4, 2), recv(2, 4, 3, "[8]"), allreduce(3, [0, 4], "X")]))
    assert [(o.kind, o.peer, o.tag, o.shape) for o in ops[:2]] == [("Send", 4, 2, (256, 128)),
                                                                  ("Receive", 4, 3, (8,))]
    assert ops[2].members == (0, 4) and ops[2].name == "X" and ops[2].reduce == "sum"


def test_paired_pipeline_passes(tmp_path):
    texts = {0: [send(1, 1, 0), recv(2, 1, 0)], 1: [recv(1, 0, 0), send(2, 0, 0)]}
    check = check_irs(write(tmp_path, texts), "train", stages=2, world=2)
    assert check.passed and check.per_rank[0] == {"Send": 1, "Receive": 1, "collectives": 0, "global_norm": 0,
                                                     "reduced_params": 0}


def test_receive_without_send_is_named(tmp_path):
    # the old wiring: stage 0 waits for 4 activation gradients stage 1 never sends
    texts = {0: [send(i, 1, i) for i in range(4)] + [recv(10 + i, 1, i) for i in range(4)],
             1: [recv(i, 0, i) for i in range(4)]}
    check = check_irs(write(tmp_path, texts), "train", stages=2, world=2)
    assert not check.passed
    assert check.messages == ["rank 0 waits for 4 Receive from rank 1 that never sends"]


def test_tag_or_shape_mismatch_is_flagged(tmp_path):
    texts = {0: [send(1, 1, 0)], 1: [recv(1, 0, 1)]}
    assert not check_irs(write(tmp_path, texts), "g", world=2).passed
    texts = {0: [send(1, 1, 0, "[4, 4]")], 1: [recv(1, 0, 0, "[4, 8]")]}
    assert "1 Send vs 1 Receive" in check_irs(write(tmp_path, texts), "g", world=2).messages[0]


def test_member_skipping_a_collective_is_flagged(tmp_path):
    texts = {0: [allreduce(1, [0, 1]), allreduce(2, [0, 1])], 1: [allreduce(1, [0, 1])]}
    check = check_irs(write(tmp_path, texts), "g", world=2)
    assert not check.passed and "rank 0: 2 ops" in check.messages[0] and "rank 1: 1 ops" in check.messages[0]
    texts = {0: [allreduce(1, [0, 1])], 1: []}
    assert "rank 1 never joins" in check_irs(write(tmp_path, texts), "g", world=2).messages[0]


def test_global_norm_between_stages_required_when_clipping(tmp_path):
    norm = "PARALLEL_GLOBALNORM_BETWEEN_STAGES"
    texts = {0: [allreduce(1, [0, 1], norm, "2-9")], 1: [allreduce(1, [0, 1], norm, "2-9")]}
    assert check_irs(write(tmp_path, texts), "train", stages=2, world=2, needs_global_norm=True).passed
    # a world all-reduce of the loss is not the norm
    texts = {0: [allreduce(1, [0, 1], "all_reduce", "w")], 1: [allreduce(1, [0, 1], "all_reduce", "w")]}
    check = check_irs(write(tmp_path, texts), "train", stages=2, world=2, needs_global_norm=True)
    assert not check.passed and "ranks 0,1 take no part in the global-norm AllReduce" in check.messages[0]


@pytest.mark.slow
def test_old_value_and_grad_pipeline_wiring_is_flagged(tmp_path, compile_slot):
    kwargs = {"recipe_path": str(ROOT / "recipes/tiny.yaml"),
              "strategy_path": str(ROOT / "strategies/tiny-dp2-mp2-pp2.yaml"),
              "overrides": ["train.micro_batch_size=2"]}
    with compile_slot():
        rep = run_compile("targets:naohai_value_and_grad_pipeline", 8, tmp_path, timeout=900, kwargs=kwargs,
                          sys_path=[str(Path(__file__).parent)], ir_check={"stages": 2, "clip": True})
    assert rep.compiled, rep.render()           # every rank compiles ...
    assert not rep.ok and not rep.ir_checks["passed"]   # ... and the check still fails it
    messages = rep.ir_checks["graphs"][0]["messages"]
    for r in range(4):
        assert f"rank {r} waits for 4 Receive from rank {r + 4} that never sends" in messages
    assert any("global-norm AllReduce" in m for m in messages)
    per_rank = rep.ir_checks["graphs"][0]["per_rank"]
    assert [per_rank[str(r)]["Send"] for r in range(4, 8)] == [0, 0, 0, 0]


def test_frozen_weights_gradient_reduction_is_flagged(tmp_path):
    """Fine-tuning: only the named trainable parameters may have their gradients reduced; a frozen
    weight's forward gather is not a gradient reduction."""
    ok = {r: [weight_allgather(1, "layers.0.attention.q_weight"), grad_allreduce(2, "layers.0.attention.q.lora_a")]
          for r in (0, 1)}
    check = check_irs(write(tmp_path, ok), "train", world=2, trainable=["layers.0.attention.q.lora_a"])
    assert check.passed and check.per_rank[0]["reduced_params"] == 1
    bad = {r: lines + [grad_allreduce(3, "layers.0.attention.q_weight")] for r, lines in ok.items()}
    check = check_irs(write(tmp_path, bad), "train", world=2, trainable=["layers.0.attention.q.lora_a"])
    assert not check.passed and "rank 0 reduces the gradient of 1 frozen parameter(s), e.g. " \
        "layers.0.attention.q_weight" in check.messages
    assert check_irs(write(tmp_path, bad), "train", world=2).passed     # a full-training run: no such rule


def _weighted_step(loss_weighted=True, sens=True, sens_weighted=True):
    """Train-step lines as MindSpore 2.10 prints them (validate pass, a tiny dp2-mp2-pp2 SFT step; a
    first-stage rank has no ``sens`` node: its gradients arrive from the last stage)."""
    lines = ['  %255(ValueNode_340) = Load(%para42_sft.token_weight, UMonad[U]) primitive_attrs: {output_names: '
             '[output], input_names: [ref, u]} cnode_attrs: {checkpoint: Bool(1)}',
             f'  %1348(loss) = PrimFunc_Mul(%1347, {"%255" if loss_weighted else "%1346"}) cnode_attrs: '
             '{checkpoint: Bool(1)}']
    if sens:
        lines.append(f'  %256(sens) = PrimFunc_{"Mul" if sens_weighted else "Add"}(%254, %255) cnode_attrs: '
                     '{checkpoint: Bool(1)}')
    return lines


def test_masked_loss_must_be_weighted_by_the_token_weight(tmp_path):
    """SFT: every rank's loss and every gradient seed (last stage) is scaled by the host-set token weight."""
    ok = {0: _weighted_step(sens=False), 1: _weighted_step()}
    assert check_irs(write(tmp_path, ok), "train", stages=2, world=2, token_weight="sft.token_weight").passed
    bad = {0: _weighted_step(sens=False), 1: _weighted_step(loss_weighted=False)}
    check = check_irs(write(tmp_path, bad), "train", stages=2, world=2, token_weight="sft.token_weight")
    assert not check.passed and check.messages == [
        "rank 1: loss not multiplied by the token weight 'sft.token_weight' (the masked loss must be normalised "
        "by the global batch's learned tokens)"]
    for seedless in ({0: _weighted_step(sens=False), 1: _weighted_step(sens=False)},      # last stage: no seed
                     {0: _weighted_step(sens_weighted=False), 1: _weighted_step()}):      # an unweighted seed
        check = check_irs(write(tmp_path, seedless), "train", stages=2, world=2, token_weight="sft.token_weight")
        assert not check.passed and "sens not multiplied" in check.messages[0], check.messages
    assert check_irs(write(tmp_path, bad), "train", stages=2, world=2).passed     # pretraining: no such rule
