"""Reference-format checkpoints in and out, checked against a numpy forward of the reference networks."""
import os

import numpy as np
import pytest
from mindspore import Tensor

import reference_forward as ref
from naohai.config import MODEL_PRESETS, ModelConfig
from naohai.convert.files import read_reference, write_ckpt
from naohai.convert.names import from_reference, to_reference
from naohai.convert.weights import assign_weights, read_weights
from naohai.errors import UserError
from naohai.model.transformer import NaohaiLM

TINY = dict(hidden_size=16, num_heads=4, seq_length=8, compute_dtype="float32", softmax_fp32=True)

# family -> (naohai model config, checkpoint format, reference dims)
FAMILIES = {
    "pangu": (dict(MODEL_PRESETS["pangu-alpha-2.6b"], **TINY, vocab_size=40, num_layers=3, ffn_hidden_size=64),
              "pangu-alpha"),
    "pcm7b": (dict(MODEL_PRESETS["pengcheng-mind-7b"], **TINY, vocab_size=64, vocab_pad_multiple=64, num_layers=2,
                   ffn_hidden_size=24), "pengcheng-mind"),
    "pcm200b": (dict(MODEL_PRESETS["pengcheng-mind-200b"], **TINY, vocab_size=64, vocab_pad_multiple=64,
                     num_layers=3, ffn_hidden_size=64), "pengcheng-mind"),
}


def setup(family, seed=0):
    raw, fmt = FAMILIES[family]
    cfg = ModelConfig(**raw)
    cfg.validate()
    w = ref.make_weights(np.random.RandomState(seed), family=family, vocab=cfg.padded_vocab_size,
                         hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size, layers=cfg.num_layers, seq=cfg.seq_length)
    return cfg, fmt, w


def packed_ids(cfg, seed=1):
    """Two packed rows of s + 1 ids: row 0 with EODs inside, row 1 ending in padding."""
    rng = np.random.RandomState(seed)
    s = cfg.seq_length
    ids = rng.randint(7, cfg.vocab_size, (2, s + 1)).astype(np.int32)
    ids[0, 2] = ids[0, 5] = cfg.eod_id
    ids[1, 4] = cfg.eod_id
    ids[1, 5:] = cfg.loss_pad_id
    return ids


def reference_loss(cfg, family, w, ids):
    return ref.loss(w, ids, family=family, heads=cfg.num_heads, layers=cfg.num_layers, eod_id=cfg.eod_id,
                    pad_id=cfg.loss_pad_id, eod_reset=cfg.eod_reset, reset_positions=cfg.eod_reset_positions)


def naohai_loss(cfg, weights, ids):
    model = NaohaiLM(cfg)
    assign_weights(model, weights)
    return float(model(Tensor(ids[:, :-1]), Tensor(ids[:, 1:])).asnumpy()), model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imported_model_matches_the_reference_forward(family):
    cfg, fmt, w = setup(family)
    ids = packed_ids(cfg)
    want = reference_loss(cfg, family, w, ids)
    got, _ = naohai_loss(cfg, from_reference(w, cfg, fmt), ids)
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)


@pytest.mark.parametrize("family", ["pangu", "pcm7b"])
def test_eod_reset_and_pad_mask_change_the_loss(family):
    """The options are live: the reference loss without them differs, and naohai follows each."""
    cfg, fmt, w = setup(family)
    ids = packed_ids(cfg)
    plain = ref.loss(w, ids, family=family, heads=cfg.num_heads, layers=cfg.num_layers, eod_id=cfg.eod_id,
                     pad_id=-1, eod_reset=False, reset_positions=False)
    assert abs(plain - reference_loss(cfg, family, w, ids)) > 1e-3


def test_pangu_final_norm_placement_matters():
    cfg, fmt, w = setup("pangu")
    ids = packed_ids(cfg)
    import dataclasses
    after = dataclasses.replace(cfg, final_norm="after")
    got_after, _ = naohai_loss(after, from_reference(w, after, fmt), ids)
    assert abs(got_after - reference_loss(cfg, "pangu", w, ids)) > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_files_is_bit_exact(family, tmp_path):
    cfg, fmt, w = setup(family)
    ours = from_reference(w, cfg, fmt)
    back = to_reference(ours, cfg, fmt)
    assert set(back) == set(w)
    for k in w:
        assert back[k].shape == w[k].shape and np.array_equal(back[k], w[k]), k
    # weights read out of a model, written in the reference format, read and imported again
    model = NaohaiLM(cfg)
    assign_weights(model, ours)
    path = write_ckpt(to_reference(read_weights(model), cfg, fmt), str(tmp_path / "ref.ckpt"))
    again = from_reference(read_reference(path), cfg, fmt, where=path)
    for k, v in ours.items():
        assert np.array_equal(again[k], v), k


def test_swiglu_mapping_halves_are_gate_then_up():
    cfg, fmt, w = setup("pcm7b")
    ours = from_reference(w, cfg, fmt)
    f = cfg.ffn_hidden_size
    mapping = w["backbone.blocks.0.output.mapping.weight"]
    assert np.array_equal(ours["layers.0.mlp.gate_weight"], mapping[:, :f].T)
    assert np.array_equal(ours["layers.0.mlp.up_weight"], mapping[:, f:].T)


def test_pangu_release_tables_as_npy_and_optimizer_state_are_accepted(tmp_path):
    cfg, fmt, w = setup("pangu")
    tables = {"backbone.embedding.word_embedding.embedding_table": "word_embedding.npy",
              "backbone.embedding.position_embedding.embedding_table": "position_embedding.npy",
              "backbone.top_query_embedding.embedding_table": "top_query_embedding.npy"}
    rest = {k: v for k, v in w.items() if k not in tables}
    rest["adam_m.backbone.layernorm.gamma"] = np.zeros(cfg.hidden_size, np.float32)
    write_ckpt(rest, str(tmp_path / "model.ckpt"))
    for name, npy in tables.items():
        np.save(tmp_path / npy, w[name])
    ours = from_reference(read_reference(str(tmp_path)), cfg, fmt)
    assert np.array_equal(ours["layers.2.attention.query_embedding"], w["backbone.top_query_embedding.embedding_table"])


def test_unpadded_word_table_gets_zero_rows():
    cfg, fmt, w = setup("pcm7b")
    import dataclasses
    cfg = dataclasses.replace(cfg, vocab_size=60)                     # padded to 64
    w = dict(w)
    table = w["backbone.embedding.word_embedding.embedding_table"][:60]
    w["backbone.embedding.word_embedding.embedding_table"] = table
    ours = from_reference(w, cfg, fmt)
    assert ours["embedding.word_embedding"].shape == (64, cfg.hidden_size)
    assert np.array_equal(ours["embedding.word_embedding"][:60], table)
    assert not ours["embedding.word_embedding"][60:].any()


def test_mismatches_are_user_errors(tmp_path):
    cfg, fmt, w = setup("pangu")
    bad = dict(w)
    bad["backbone.blocks.0.attention.dense1.weight"] = np.zeros((8, 16), np.float32)
    with pytest.raises(UserError, match="dense1.weight' has shape"):
        from_reference(bad, cfg, fmt)
    missing = {k: v for k, v in w.items() if not k.startswith("backbone.top_query_layer.")}
    with pytest.raises(UserError, match="top_query_layer"):
        from_reference(missing, cfg, fmt)
    extra = dict(w, **{"backbone.blocks.9.layernorm1.gamma": np.ones(16, np.float32)})
    with pytest.raises(UserError, match="no place for"):
        from_reference(extra, cfg, fmt)
    import dataclasses
    with pytest.raises(UserError, match="model.norm"):
        from_reference(w, dataclasses.replace(cfg, norm="rmsnorm"), fmt)
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="readable"):
        read_reference(str(tmp_path / "junk.ckpt"))
    with pytest.raises(UserError, match="not found"):
        read_reference(os.path.join(str(tmp_path), "nope"))
