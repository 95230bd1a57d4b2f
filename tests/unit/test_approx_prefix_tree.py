"""The router's approximate prefix tree forgets the least recently used leaf first, at a cost per forgotten block
that does not grow with the tree."""

from __future__ import annotations

import random

from pdspark.router.workers import approx_prefix_tree
from pdspark.router.workers.approx_prefix_tree import ApproxPrefixTree

B = 4  # tokens per block


def blocks(*ids: int) -> list[int]:
    """A prompt of whole blocks; block `i` is `B` copies of token `i`."""
    return [t for i in ids for t in [i] * B]


def held(tree: ApproxPrefixTree, *ids: int) -> bool:
    """Whether the tree still holds the path of blocks `ids` (whichever workers it remembers there)."""
    node = tree.root
    for key in (tuple(blocks(i)) for i in ids):
        if key not in node.children:
            return False
        node = node.children[key]
    return True


def test_evicts_the_least_recently_used_leaf_first():
    tree = ApproxPrefixTree(block=B, max_blocks=4)
    tree.insert(blocks(1, 2), "a")  # chain 1 -> 2
    tree.insert(blocks(3), "b")
    tree.insert(blocks(1), "a")  # 1 is used again; its child 2 is not
    tree.insert(blocks(4), "b")
    assert tree.num_blocks == 4
    tree.insert(blocks(5), "a")
    assert not held(tree, 1, 2) and held(tree, 1)  # 2: the oldest leaf
    tree.insert(blocks(6), "a")
    # 1 became a leaf only now, but it was used after 3: 3 goes.
    assert not held(tree, 3) and held(tree, 1)
    tree.insert(blocks(7), "a")
    assert not held(tree, 1) and all(held(tree, i) for i in (4, 5, 6, 7))
    assert tree.num_blocks == 4
    assert tree.match(blocks(5, 9)) == {"a": B}


def paths(tree: ApproxPrefixTree) -> set[tuple[int, ...]]:
    """Every path of blocks the tree holds, as tuples of block ids."""
    out, stack = set(), [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for key, child in node.children.items():
            out.add(path + (key[0],))
            stack.append((child, path + (key[0],)))
    return out


def test_random_workload_forgets_what_a_plain_scan_would():
    """The rule stated plainly (scan every held path for the leaf used longest ago) against the tree."""
    rng = random.Random(5)
    tree = ApproxPrefixTree(block=B, max_blocks=12)
    last_use: dict[tuple[int, ...], int] = {}  # held path -> step of its last use
    for step in range(400):
        ids = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]  # few block ids: long shared prefixes
        tree.insert(blocks(*ids), rng.choice("ab"))
        for i in range(1, len(ids) + 1):
            last_use[tuple(ids[:i])] = step
        while len(last_use) > 12:
            leaves = [p for p in last_use if not any(len(q) > len(p) and q[: len(p)] == p for q in last_use)]
            del last_use[min(leaves, key=last_use.__getitem__)]
        assert paths(tree) == set(last_use), step


def test_a_removed_worker_takes_its_uses_out_of_the_order():
    tree = ApproxPrefixTree(block=B, max_blocks=3)
    tree.insert(blocks(1), "a")
    tree.insert(blocks(2), "b")
    tree.insert(blocks(3), "a")
    tree.insert(blocks(1), "b")  # 1: last used by b, before that by a (before 3)
    tree.remove_worker("b")  # 2 is no one's now; 1's last use is a's, older than 3
    tree.insert(blocks(4), "a")
    assert not held(tree, 2) and held(tree, 1)
    tree.insert(blocks(5), "a")
    assert not held(tree, 1) and held(tree, 3)
    assert tree.match(blocks(3)) == {"a": B}


def test_eviction_work_does_not_grow_with_the_tree(monkeypatch):
    """Count every attribute read of a tree node while one insert evicts one block, in a tree of 100 blocks and in
    one of 10,000: a scan of the tree reads every node; an ordered structure reads the same few either way."""
    counting = {"on": False, "reads": 0}
    read = object.__getattribute__

    def counted(node, name):
        if counting["on"]:
            counting["reads"] += 1
        return read(node, name)

    monkeypatch.setattr(approx_prefix_tree._Node, "__getattribute__", counted)

    def reads_to_evict_one(size: int) -> int:
        tree = ApproxPrefixTree(block=B, max_blocks=size)
        for i in range(size // 4):  # chains of 4 blocks under the root
            tree.insert(blocks(*range(4 * i + 10, 4 * i + 14)), "a")
        assert tree.num_blocks == size
        counting.update(on=True, reads=0)
        tree.insert(blocks(1), "b")  # one block more than the tree keeps: one eviction
        counting["on"] = False
        assert tree.num_blocks == size and not held(tree, 10, 11, 12, 13) and held(tree, 10, 11, 12)
        return counting["reads"]

    small, large = reads_to_evict_one(100), reads_to_evict_one(10_000)
    assert large <= 2 * small, (small, large)
