"""The block hashes an engine holds, exactly as its KV events say (one ``BlockIndex`` per backend).

Why exact and per backend: the gateway's own prefix index is a belief built from its routing
decisions; this one is the engine's word. ``BlockStored`` adds hashes (each with its parent
link, the block before it in the chain), ``BlockRemoved`` drops them, ``AllBlocksCleared``
empties the index. ``match(hashes)`` counts the leading hashes of a prompt's chain the engine
holds: prefix caching reuses a chain from its start only, so the first missing block ends the
match even if later ones are held.

Bounded memory: at most ``max_blocks`` hashes (the engine's own block count is the natural
bound). Past it the oldest stored hash is forgotten first: the index then under-reports, never
claims a block the engine may not have.

Not modelled (yet): the medium (GPU, CPU offload) and the KV-cache group (hybrid models) of a
block; a hash is held or not. ``KvBlockIndexes`` is the ``KvEventSink`` holding every backend's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch

DEFAULT_MAX_BLOCKS = 1 << 20
"""About 100 MiB of hashes at most per backend: far above a GPU's block count (hundreds of thousands)."""


class BlockIndex:
    """One engine's held block hashes, each with its parent (None at a chain's start)."""

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._parent: OrderedDict[BlockHash, BlockHash | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._parent

    def parent(self, block_hash: BlockHash) -> BlockHash | None:
        """The block before ``block_hash`` in its chain; KeyError when not held."""
        return self._parent[block_hash]

    def apply(self, batch: EventBatch) -> None:
        """Every event of a batch, in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.store(event.block_hashes, event.parent_block_hash)
            elif isinstance(event, BlockRemoved):
                self.remove(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def store(self, hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """A chain run: each hash's parent is the one before it, the first's is ``parent``."""
        for block_hash in hashes:
            self._parent[block_hash] = parent
            self._parent.move_to_end(block_hash)
            parent = block_hash
        while len(self._parent) > self.max_blocks:
            self._parent.popitem(last=False)

    def remove(self, hashes: Iterable[BlockHash]) -> None:
        for block_hash in hashes:
            self._parent.pop(block_hash, None)

    def clear(self) -> None:
        self._parent.clear()

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes`` (a prompt's chain, in order) the engine holds from the start."""
        held = 0
        for block_hash in hashes:
            if block_hash not in self._parent:
                break
            held += 1
        return held


class KvBlockIndexes:
    """Every backend's ``BlockIndex``, fed by the subscribers (a ``KvEventSink``)."""

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self._max_blocks = max_blocks
        self._indexes: dict[str, BlockIndex] = {}

    def apply(self, backend: str, batch: EventBatch) -> None:
        self.index(backend).apply(batch)

    def index(self, backend: str) -> BlockIndex:
        """The backend's index, empty until its first event."""
        index = self._indexes.get(backend)
        if index is None:
            index = self._indexes[backend] = BlockIndex(max_blocks=self._max_blocks)
        return index

    def match(self, backend: str, hashes: Sequence[BlockHash]) -> int:
        index = self._indexes.get(backend)
        return 0 if index is None else index.match(hashes)

    def forget(self, backend: str) -> None:
        """A backend left the policy: its index goes with it."""
        self._indexes.pop(backend, None)
