import numpy as np
import pytest

from naohai.data.loader import TokenWindowLoader, eval_batches
from naohai.data.prepare import load_prepared, prepare
from naohai.errors import UserError

SEQ = 16


@pytest.fixture(scope="module")
def prep_dir(tok, mixed_docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("loader") / "data"
    prepare(iter(mixed_docs[:30:3]), tok, str(out), SEQ, holdout_fraction=0.1, seed=1, progress=False)
    return str(out)


def _windows(prep_dir, split="train"):
    prep = load_prepared(prep_dir)
    return np.stack([prep.window(split, i) for i in range(prep.num_windows(split))]).astype(np.int32)


def _take(loader, windows):
    """Next batch, checked to hold the windows the loader says; returns their indices."""
    idx = loader.window_indices(loader.sample + loader.rank * loader.local_batch_size, loader.local_batch_size)
    batch = loader.next_batch()
    np.testing.assert_array_equal(batch, windows[idx])
    return [int(i) for i in idx]


def test_shape_dtype_and_determinism(prep_dir):
    a = TokenWindowLoader(prep_dir, "train", 8, seed=5)
    b = TokenWindowLoader(prep_dir, "train", 8, seed=5)
    c = TokenWindowLoader(prep_dir, "train", 8, seed=6)
    ba, bb, bc = a.next_batch(), b.next_batch(), c.next_batch()
    assert ba.shape == (8, SEQ + 1) and ba.dtype == np.int32
    np.testing.assert_array_equal(ba, bb)
    assert not np.array_equal(ba, bc)


def test_every_window_once_per_epoch_and_reshuffle(prep_dir):
    windows = _windows(prep_dir)
    n = len(windows)
    loader = TokenWindowLoader(prep_dir, "train", 1, seed=3)
    epoch0 = [_take(loader, windows)[0] for _ in range(n)]
    assert loader.epoch == 1 and loader.epoch_progress == 1.0
    epoch1 = [_take(loader, windows)[0] for _ in range(n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1 and epoch0 != list(range(n))


def test_batches_straddling_epochs_keep_the_sample_order(prep_dir):
    windows = _windows(prep_dir)
    n = len(windows)
    single = TokenWindowLoader(prep_dir, "train", 1, seed=9)
    order = [_take(single, windows)[0] for _ in range(3 * n)]
    big = TokenWindowLoader(prep_dir, "train", 7, seed=9)
    got = sum((_take(big, windows) for _ in range((3 * n) // 7)), [])
    assert got == order[:len(got)]


@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_concatenate_to_global_batch(prep_dir, world):
    glob = TokenWindowLoader(prep_dir, "train", 8, seed=11)
    ranks = [TokenWindowLoader(prep_dir, "train", 8, rank=r, world_size=world, seed=11) for r in range(world)]
    for _ in range(25):
        full = glob.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert all(p.shape == (8 // world, SEQ + 1) for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), full)


def test_resume_at_any_point_equals_uninterrupted(prep_dir):
    ref = TokenWindowLoader(prep_dir, "train", 6, rank=1, world_size=2, seed=4)
    expected = [ref.next_batch() for _ in range(40)]
    for stop in (0, 1, 13, 39):
        first = TokenWindowLoader(prep_dir, "train", 6, rank=1, world_size=2, seed=4)
        for _ in range(stop):
            first.next_batch()
        state = first.state_dict()
        resumed = TokenWindowLoader(prep_dir, "train", 6, rank=1, world_size=2, seed=4)
        resumed.load_state_dict(state)
        for i in range(stop, 40):
            np.testing.assert_array_equal(resumed.next_batch(), expected[i])
    # start_sample is the same thing as a loaded state
    direct = TokenWindowLoader(prep_dir, "train", 6, rank=1, world_size=2, seed=4, start_sample=6 * 13)
    np.testing.assert_array_equal(direct.next_batch(), expected[13])


def test_resume_with_other_seed_is_refused(prep_dir):
    state = TokenWindowLoader(prep_dir, "train", 4, seed=1).state_dict()
    with pytest.raises(UserError):
        TokenWindowLoader(prep_dir, "train", 4, seed=2).load_state_dict(state)


def test_valid_eval_batches_fixed_and_in_order(prep_dir):
    windows = _windows(prep_dir, "valid")
    batches = list(eval_batches(prep_dir, 2, 3))
    again = list(eval_batches(prep_dir, 2, 3))
    for a, b in zip(batches, again):
        np.testing.assert_array_equal(a, b)
    flat = np.concatenate(batches)
    expected = windows[np.arange(6) % len(windows)]
    np.testing.assert_array_equal(flat, expected)


def test_batch_not_divisible_by_ranks(prep_dir):
    with pytest.raises(UserError) as err:
        TokenWindowLoader(prep_dir, "train", 6, rank=0, world_size=4)
    assert err.value.key == "train.global_batch_size"
