"""FLOPs per token (PaLM appendix B) against a hand count of the tiny preset's matmuls."""
from naohai.config import MODEL_PRESETS, ModelConfig
from naohai.model.flops import flops_per_token


def test_tiny_flops_hand_count():
    cfg = ModelConfig(**MODEL_PRESETS["tiny"])   # h 128, 4 layers, SwiGLU 352, vocab 2048, seq 128, biases
    h, f, v, s, layers = 128, 352, 2048, 128, 4
    per_layer = 4 * h * h + 4 * h + 3 * f * h + 2 * f + h + 4 * h   # q,k,v,out (+bias), up/gate/down (+bias), 2 LN
    n = v * h + layers * per_layer + 2 * h                           # tied table once + final LN
    assert flops_per_token(cfg) == 6 * n + 12 * layers * h * s


def test_lookup_tables_do_no_matmul_work():
    base = dict(MODEL_PRESETS["tiny-pangu"])
    cfg = ModelConfig(**base)
    longer = ModelConfig(**dict(base, max_positions=4 * cfg.seq_length))   # bigger position tables only
    assert flops_per_token(longer) == flops_per_token(cfg)
