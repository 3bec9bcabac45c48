import numpy as np
import pytest
import torch
from scipy import stats
from support.replay_reference import sum_tree_bytes, tree_reference_find, update_max

from fitdqn.ops import prioritized as prioritized_ops
from fitdqn.replay.sum_tree import SumTree, level_sizes


def check_internal_sums(tree: SumTree, exact: bool) -> None:
    """Every stored node equals the sum of its children (recomputed here in NumPy)."""
    for depth in range(len(tree.levels) - 1, 0, -1):
        children = tree.levels[depth].numpy().reshape(-1, tree.fanout).sum(-1)
        parent = tree.levels[depth - 1].numpy()
        if exact:
            np.testing.assert_array_equal(parent[: children.size], children)
        else:
            np.testing.assert_allclose(parent[: children.size], children, rtol=1e-13, atol=0)
        assert not parent[children.size:].any()
        # the same torch reduction over all rows gives bit-identical nodes: no drift from deltas
        recomputed = tree.levels[depth].view(-1, tree.fanout).sum(-1)
        assert torch.equal(tree.levels[depth - 1][: recomputed.numel()], recomputed)


@pytest.mark.parametrize("num_leaves,fanout", [(1, 2), (5, 2), (64, 4), (1000, 8), (4097, 64)])
def test_level_sizes_cover_the_leaves(num_leaves, fanout):
    sizes = level_sizes(num_leaves, fanout)
    assert sizes[0] == fanout and sizes[-1] >= num_leaves
    assert all(size % fanout == 0 for size in sizes)
    for parent, child in zip(sizes, sizes[1:], strict=False):
        assert parent >= child // fanout
    tree = SumTree(num_leaves, fanout, "cpu")
    assert sum(level.numel() * 8 for level in tree.levels) == sum_tree_bytes(num_leaves, fanout)


@pytest.mark.parametrize("fanout", [2, 4, 64])
def test_updates_with_duplicates_match_numpy(fanout):
    """Random update sequences with duplicated indices: leaves follow 'max wins', nodes stay exact sums."""
    rng = np.random.default_rng(fanout)
    n = 777
    tree = SumTree(n, fanout, "cpu")
    ref = np.zeros(n)
    for round_ in range(60):
        index = rng.integers(0, n, size=64)
        index[:8] = index[8:16]  # force duplicates
        integer = round_ % 2 == 0
        values = rng.integers(0, 20, size=64).astype(float) if integer else rng.random(64) * 3
        if round_ % 5 == 4:  # unique assignment path (what write() uses)
            index = rng.permutation(n)[:64]
            tree.assign(torch.from_numpy(index), torch.from_numpy(values))
            ref[index] = values
        else:
            update_max(tree, torch.from_numpy(index), torch.from_numpy(values))
            for i in np.unique(index):
                ref[i] = values[index == i].max()
        np.testing.assert_array_equal(tree.leaves.numpy()[:n], ref)
        assert not tree.leaves.numpy()[n:].any()
        check_internal_sums(tree, exact=False)
        assert float(tree.total()) == pytest.approx(ref.sum(), rel=1e-12)


def test_integer_priorities_are_exact_and_find_matches_searchsorted():
    rng = np.random.default_rng(1)
    n = 3000
    tree = SumTree(n, 16, "cpu")
    ref = rng.integers(0, 6, size=n).astype(float)  # zeros included: must never be found
    update_max(tree, torch.arange(n), torch.from_numpy(ref))
    check_internal_sums(tree, exact=True)
    total = ref.sum()
    mass = np.concatenate([rng.random(5000) * total, np.arange(int(total)), [0.0, total - 1e-9]])
    found = prioritized_ops.descend(tree.levels, torch.from_numpy(mass), tree.fanout, tree.num_leaves).numpy()
    np.testing.assert_array_equal(found, tree_reference_find(ref, mass))
    assert (ref[found] > 0).all()


def test_total_mass_or_more_never_returns_an_empty_leaf():
    tree = SumTree(100, 4, "cpu")
    update_max(tree, torch.tensor([3, 50, 97]), torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
    found = prioritized_ops.descend(tree.levels, torch.tensor([0.6, 0.6000001, 1e9, -1.0], dtype=torch.float64),
                                   tree.fanout, tree.num_leaves)
    assert found.tolist() == [97, 97, 97, 3]


def test_stratified_sampling_frequencies_match_priorities():
    """Chi-square goodness of fit of sampled counts against p_i / total (fixed seed, loose threshold)."""
    rng = np.random.default_rng(2)
    n = 200
    priorities = rng.random(n) ** 2 + 0.01
    priorities[rng.permutation(n)[:40]] = 0.0
    tree = SumTree(n, 8, "cpu")
    update_max(tree, torch.arange(n), torch.from_numpy(priorities))
    generator = torch.Generator().manual_seed(3)
    counts = np.zeros(n)
    probabilities = []
    for _ in range(100):
        uniform = torch.rand(1000, dtype=torch.float64, generator=generator)  # [B]
        index, probability = prioritized_ops.stratified_find(tree.levels, uniform, tree.fanout, tree.num_leaves)
        counts += np.bincount(index.numpy(), minlength=n)
        probabilities.append((index.numpy(), probability.numpy()))
    live = priorities > 0
    assert counts[~live].sum() == 0
    expected = priorities[live] / priorities.sum() * counts.sum()
    _, p_value = stats.chisquare(counts[live], expected)
    assert p_value > 1e-3
    for index, probability in probabilities:
        np.testing.assert_allclose(probability, priorities[index] / priorities.sum(), rtol=1e-12)


def test_state_dict_round_trip_and_propagating_every_leaf_rebuilds_the_tree():
    tree = SumTree(500, 8, "cpu")
    update_max(tree, torch.arange(0, 500, 3), torch.rand(167, dtype=torch.float64))
    copy = SumTree(500, 8, "cpu")
    copy.load_state_dict({k: v.clone() for k, v in tree.state_dict().items()})
    for a, b in zip(tree.levels, copy.levels, strict=True):
        assert torch.equal(a, b)
    for level in copy.levels[:-1]:
        level.zero_()
    copy.propagate(torch.arange(500))  # every internal node again from the leaves
    check_internal_sums(copy, exact=False)
    assert float(copy.total()) == pytest.approx(float(tree.total()), rel=1e-13)
