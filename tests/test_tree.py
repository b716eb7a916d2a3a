"""TokenTree: hand-built trees with their masks, positions and drawings pinned."""
import pytest
import torch

from offspec.spec.tree import TokenTree


def small_tree() -> TokenTree:
    """root 17 -> (42 -> 7), 13"""
    tree = TokenTree(17)
    assert tree.add(0, 42, 0.6) == 1
    assert tree.add(0, 13, 0.2) == 2
    assert tree.add(1, 7, 0.3) == 3
    return tree


def test_tensors_mask_and_positions_are_pinned():
    tree = small_tree()
    assert tree.tokens.tolist() == [17, 42, 13, 7]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.values.tolist() == [1.0, 0.6, 0.2, 0.3]
    assert tree.mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert tree.positions(7).tolist() == [7, 8, 8, 9]
    assert tree.size == 3 and tree.n_nodes == 4 and tree.depth == 2


def test_navigation():
    tree = small_tree()
    assert tree.children(0) == [1, 2]
    assert tree.children(1) == [3]
    assert tree.children(3) == []
    assert tree.path_to(3) == [0, 1, 3]
    assert tree.path_to(0) == [0]
    assert tree.origin.tolist() == [0, 1, 2, 3]     # a hand-built tree is its own working tree
    assert all(tree.expanded(n) for n in range(4))


def test_draw_is_readable():
    tree = small_tree()
    assert tree.draw() == (
        "[0] 17  v=1.0000\n"
        "  [1] 42  v=0.6000\n"
        "    [3] 7  v=0.3000\n"
        "  [2] 13  v=0.2000"
    )
    assert tree.draw(decode=lambda t: chr(ord("a") + t % 26)).splitlines()[1] == "  [1] 42 'q'  v=0.6000"


def test_root_only():
    tree = TokenTree.root_only(5)
    assert tree.size == 0 and tree.depth == 0
    assert tree.tokens.tolist() == [5] and tree.mask.tolist() == [[True]]
    assert tree.positions(3).tolist() == [3]


def naive_mask(parents: list[int]) -> torch.Tensor:
    N = len(parents)
    mask = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_mask_grows_incrementally_past_capacity():
    """Reading the mask mid-growth, then adding more nodes (past the initial capacity), keeps it exact."""
    g = torch.Generator().manual_seed(0)
    tree = TokenTree(0, capacity=1)
    for i in range(1, 120):
        parent = int(torch.randint(0, i, (1,), generator=g))
        tree.add(parent, i, 1.0 / i)
        if i in (1, 5, 33, 64):
            assert torch.equal(tree.mask, naive_mask(tree.parents.tolist()))
            assert tree.tokens.shape == (i + 1,)
    assert torch.equal(tree.mask, naive_mask(tree.parents.tolist()))
    parents = tree.parents
    depths = tree.depths
    assert (depths[1:] == depths[parents[1:]] + 1).all()


def test_bad_parent_is_refused():
    with pytest.raises(IndexError, match="parent 9"):
        small_tree().add(9, 1, 0.1)
