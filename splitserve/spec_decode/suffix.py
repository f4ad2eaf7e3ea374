"""Suffix decoding ("suffix", after Arctic Inference's method that vLLM ships): draft from suffix
trees of what the request and recent requests already wrote.

Two tries of token windows, each node counting how often its path occurred:
- one per running request, over its prompt and output so far (every window of up to
  `max_tree_depth` tokens starting at each position, extended as tokens arrive);
- one global, over the outputs of the last `max_cached_requests` finished requests, so that
  agentic loops and repeated tasks find continuations written by earlier requests. A request that
  leaves the cache has its windows counted out again.

A proposal matches the longest suffix of the sequence (up to the depth) found in a trie, then walks
down from it, at each step to the child seen most often, while the path's estimated probability
(the product of child count / parent count) stays at least `min_token_prob`, for at most
`max_spec_factor` x the match length tokens. The trie whose draft has the larger expected number
of accepted tokens (the sum of the path's probabilities) wins.
"""

from __future__ import annotations

from collections import OrderedDict


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class _Frontier:
    """Where a sequence's counting stopped: its length counted and the nodes of the windows ending there."""

    __slots__ = ("end", "nodes")

    def __init__(self):
        self.end = 0
        self.nodes: list[_Node] = []  # shortest window first


class SuffixTrie:
    """Windows of up to `depth` tokens of the sequences added, counted per path."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Count (sign 1) or count out (sign -1) every window of a whole sequence."""
        self.extend(tokens, _Frontier(), sign)

    def extend(self, tokens: list[int], frontier: _Frontier, sign: int = 1) -> None:
        """Count the windows that end at positions frontier.end + 1 .. len(tokens). The frontier holds
        the nodes of the windows ending at frontier.end (one per length): each new token extends
        each of them by one and starts a window of its own, O(depth) per token."""
        for token in tokens[frontier.end :]:
            extended = []
            for node in [self.root, *frontier.nodes[: self.depth - 1]]:
                child = node.children.get(token)
                if child is None:
                    if sign < 0:
                        continue
                    child = node.children[token] = _Node()
                child.count += sign
                if child.count <= 0:  # its extensions are counted out too, so the subtree goes
                    del node.children[token]
                extended.append(child)
            frontier.nodes, frontier.end = extended, frontier.end + 1

    def _find(self, suffix: list[int]) -> _Node | None:
        node = self.root
        for token in suffix:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def longest_match(self, tokens: list[int], max_length: int) -> tuple[int, _Node | None]:
        """(length, node) of the longest suffix of tokens, at most max_length long, present in the
        trie with something after it (0, None if none). A present suffix's own suffixes are present
        too, so the lengths present form a prefix range."""
        lo, hi, best = 1, min(max_length, len(tokens)), (0, None)
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self._find(tokens[len(tokens) - mid :])
            if node is not None and node.children:
                best, lo = (mid, node), mid + 1
            elif node is not None:  # present but nothing follows it yet: a longer match cannot help
                hi = mid - 1
            else:
                hi = mid - 1
        return best

    def draft(self, tokens: list[int], max_drafts: int, max_spec_factor: float, min_prob: float):
        """(draft tokens, expected accepted tokens) continuing the longest match. Windows end at the
        trie's depth, so the match is kept short enough to leave room for max_drafts tokens after it."""
        length, node = self.longest_match(tokens, max(1, self.depth - max_drafts))
        if node is None:
            return [], 0.0
        limit = min(max_drafts, int(max_spec_factor * length))
        drafts, prob, score = [], 1.0, 0.0
        while len(drafts) < limit and node.children:
            total = sum(child.count for child in node.children.values())
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            drafts.append(token)
            score += prob
            node = child
        return drafts, score


class SuffixProposer:
    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float):
        self.depth, self.max_cached = max_tree_depth, max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.global_trie = SuffixTrie(max_tree_depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # finished requests' outputs, oldest first
        self._local: dict[str, tuple[SuffixTrie, _Frontier]] = {}  # request -> its trie and where counting stopped

    def propose(self, request_id: str, tokens: list[int], max_drafts: int) -> list[int]:
        if max_drafts < 1:
            return []
        trie, frontier = self._local.setdefault(request_id, (SuffixTrie(self.depth), _Frontier()))
        # The last token is counted at the next proposal, so that the suffix does not match itself.
        trie.extend(tokens[: len(tokens) - 1], frontier)
        local = trie.draft(tokens, max_drafts, self.max_spec_factor, self.min_token_prob)
        shared = self.global_trie.draft(tokens, max_drafts, self.max_spec_factor, self.min_token_prob)
        return max(local, shared, key=lambda d: d[1])[0]

    def finish(self, request_id: str, tokens: list[int], num_prompt_tokens: int) -> None:
        """The request is done: its output joins the global trie (the oldest cached one leaves)."""
        self._local.pop(request_id, None)
        if self.max_cached == 0:
            return
        output = tokens[num_prompt_tokens:]
        if not output:
            return
        self.global_trie.add(output)
        self._cached[request_id] = output
        while len(self._cached) > self.max_cached:
            _, evicted = self._cached.popitem(last=False)
            self.global_trie.add(evicted, sign=-1)
