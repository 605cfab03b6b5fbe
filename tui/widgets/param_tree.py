"""The parameter tree: tensors grouped by their dotted names, numeric groups (layers) sorted
numerically and labelled ``layers.0..27``; a fuzzy filter narrows it. For a checkpoint whose
reader renamed tensors (Megatron), it can group them under the names they come from instead.

One widget serves the inspector (leaves carry :class:`core.TensorInfo`) and the compare view
(leaves carry :class:`core.diff.TensorDiff`): a leaf's data is any object with a ``name``; the
caller may give the leaf label, a note for each group (e.g. how many of its tensors changed),
and an order (siblings by the largest rank found under them, e.g. the largest change first)."""

from __future__ import annotations

from typing import Any, Callable

from rich.text import Text
from textual.widgets import Tree
from textual.widgets._tree import TreeNode

from shardscope.core.plan import natural_key
from shardscope.tui.format import human_bytes, human_count


def fuzzy_match(query: str, name: str) -> bool:
    """True when the characters of ``query`` appear in ``name`` in order (case-insensitive);
    space-separated words must each match."""
    name = name.lower()
    for word in query.lower().split():
        pos = 0
        for ch in word:
            pos = name.find(ch, pos)
            if pos < 0:
                return False
            pos += 1
    return True


def tensor_label(key: str, v) -> Text:
    """The inspector's leaf: last name part, shape, dtype, placement, size. Built as a
    :class:`rich.text.Text`, not markup: parsing markup was half the cost of the tree of a
    thousand tensors."""
    return Text.assemble(f"{key}  ", (str(list(v.shape)), "bold"),
                         f" {v.dtype} {v.placement} ",
                         (f"{human_count(v.numel)} el, {human_bytes(v.nbytes)}", "dim"))


class _LazyNode(TreeNode):
    """A tree node whose children may be added only when it is first expanded (or when
    :meth:`ParamTree.find` / :meth:`ParamTree.first_leaf` need them)."""

    def _expand(self, expand_all: bool) -> None:
        self._tree._fill(self)
        super()._expand(expand_all)


class ParamTree(Tree[Any]):
    """A ``Tree`` whose leaves carry the items of ``tensors`` (name -> object with ``name``,
    by default :class:`TensorInfo`) as data; group nodes carry None.

    ``label(key, item)``: a leaf's markup (``key`` is the last part of its path).
    ``group_note(items)``: markup appended to a group's label, for the items under it.
    ``rank(item)``: when given (see :meth:`set_rank`), siblings are ordered by the largest
    rank under them, largest first (ties keep the natural name order).

    A tree of at least :attr:`LAZY_AT` tensors adds a closed group's children only when the
    group is first expanded (by the user, :meth:`reveal`, :meth:`find` or
    :meth:`first_leaf`): the first screen of an 80-layer model builds a handful of nodes,
    not a thousand. Walk it with :meth:`find` / :meth:`leaves`, not ``node.children``."""

    #: trees with fewer tensors are built whole at once
    LAZY_AT = 200
    #: trees with fewer tensors open every group
    OPEN_BELOW = 40

    def __init__(self, tensors: dict[str, Any],
                 label: Callable[[str, Any], str] = tensor_label,
                 group_note: Callable[[list], str] | None = None,
                 rank: Callable[[Any], Any] | None = None, **kw):
        super().__init__("parameters", **kw)
        self.tensors = tensors
        self.label_of = label
        self.group_note = group_note
        self.rank = rank
        self.query = ""
        self.by_source = False
        self.show_root = False
        #: node id -> adds the node's children (groups not built yet)
        self._pending: dict[int, Callable[[], None]] = {}
        #: tensor name -> its leaf, for the leaves built so far
        self._leaf: dict[str, Any] = {}
        #: tensor name -> the closed group holding it whose children are not built yet
        self._holder: dict[str, Any] = {}
        self._lazy = False

    def _add_node(self, parent, label, data, expand: bool = False):
        node = _LazyNode(self, parent, self._new_id(), label, data, expanded=expand)
        self._tree_nodes[node._id] = node
        self._updates += 1
        return node

    def _fill(self, node) -> None:
        """Add ``node``'s children if they were left for later."""
        build = self._pending.pop(node._id, None)
        if build is not None:
            build()

    def _later(self, node, items: list, build: Callable[[], None]) -> None:
        """Run ``build`` (adds ``node``'s children) now, or when ``node`` is first needed if
        the tree is lazy and ``node`` is closed; ``items`` are the leaf items under it."""
        if not self._lazy or node.is_expanded:
            build()
            return
        self._pending[node._id] = build
        for item in items:
            self._holder[getattr(item, "name", None)] = node

    def on_mount(self) -> None:
        self.rebuild()

    def set_filter(self, query: str) -> None:
        if query == self.query:
            return
        self.query = query
        self.rebuild()

    def set_items(self, tensors: dict[str, Any]) -> None:
        """Show ``tensors`` instead (same label, note and order)."""
        self.tensors = tensors
        self.rebuild()

    def set_rank(self, rank: Callable[[Any], Any] | None) -> None:
        """Order siblings by ``rank`` (largest first), or by name when None."""
        self.rank = rank
        self.rebuild()

    def set_by_source(self, on: bool) -> None:
        """Group by the names the tensors come from (``TensorInfo.source``, e.g. Megatron's),
        each source listing the Hugging Face tensors cut from it; or by their own names."""
        if on != self.by_source:
            self.by_source = on
            self.rebuild()

    def _key(self, name: str) -> list[str]:
        """The path of a tensor's leaf in the tree."""
        source = getattr(self.tensors[name], "source", None)
        if self.by_source and source:
            return source.split(".") + [name]
        return name.split(".")

    def leaves(self) -> list:
        """Every tensor leaf shown (after the filter) in display order, building the groups
        left for later (they stay closed)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop(0)
            if node.data is not None:
                out.append(node)
            self._fill(node)
            stack[:0] = list(node.children)
        return out

    def first_leaf(self):
        """The first tensor node in display order (its groups built if they were not), or
        None."""
        stack = [self.root]
        while stack:
            node = stack.pop(0)
            if node.data is not None:
                return node
            self._fill(node)
            stack[:0] = list(node.children)
        return None

    def find(self, name: str):
        """The leaf of the tensor called ``name``, or None (not there, or filtered out). Builds
        the groups above it if they were left for later (they stay closed)."""
        while name not in self._leaf:
            holder = self._holder.pop(name, None)
            if holder is None:
                return None
            self._fill(holder)
        return self._leaf[name]

    def reveal(self, node) -> None:
        """Expand ``node``'s parents and put the cursor on it."""
        p = node.parent
        while p is not None:
            p.expand()
            p = p.parent
        # expand() only drops the tree's line cache: reading last_line rebuilds it now, so
        # node's line number is current and the cursor lands on it (not on a stale line)
        if self.last_line >= 0:
            self.move_cursor(node)

    def rebuild(self) -> None:
        self.clear()
        self._pending.clear()
        self._leaf.clear()
        self._holder.clear()
        paths = {n: self._key(n) for n in self.tensors}
        names = [n for n in sorted(paths, key=lambda n: natural_key(".".join(paths[n])))
                 if not self.query or fuzzy_match(self.query, ".".join(paths[n]))]
        nested: dict = {}
        for n in names:
            node = nested
            path = paths[n]
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = self.tensors[n]
        self._lazy = len(names) >= self.LAZY_AT
        self._add(self.root, nested, expand=bool(self.query) or len(names) < self.OPEN_BELOW)
        self.root.expand()

    def _items(self, v) -> list:
        """The leaf items under ``v`` (a leaf item or a nested dict)."""
        if not isinstance(v, dict):
            return [v]
        return [x for c in v.values() for x in self._items(c)]

    def _top(self, v):
        return max(self.rank(x) for x in self._items(v))

    def _group_label(self, text: str, v) -> str | Text:
        if self.group_note is None:
            return Text(text)  # plain: no markup to parse
        return f"{text}  {self.group_note(self._items(v))}"

    def _add(self, parent, tree: dict, expand: bool) -> None:
        keys = list(tree)
        if self.rank is not None:  # stable: ties keep the natural order
            keys.sort(key=lambda k: self._top(tree[k]), reverse=True)
        for k in keys:
            v = tree[k]
            if not isinstance(v, dict):
                self._leaf[getattr(v, "name", None)] = parent.add_leaf(self.label_of(k, v),
                                                                      data=v)
                continue
            nums = sorted((n for n in v if n.isdigit()), key=int)
            if len(nums) > 1 and len(nums) == len(v):
                # a stack of numbered blocks (layers, experts): one node "layers.0..27"
                group = parent.add(self._group_label(f"{k}.{nums[0]}..{nums[-1]}", v),
                                   expand=expand)
                self._later(group, self._items(v) if self._lazy else [],
                            lambda group=group, v=v, nums=nums: self._add_blocks(
                                group, v, nums, expand))
            else:
                node = parent.add(self._group_label(k, v), expand=expand)
                self._later(node, self._items(v) if self._lazy else [],
                            lambda node=node, v=v: self._add(node, v, expand))

    def _add_blocks(self, group, v: dict, nums: list[str], expand: bool) -> None:
        """The numbered blocks ``nums`` of ``v`` under ``group`` ("layers.0..27")."""
        if self.rank is not None:
            nums = sorted(nums, key=lambda n: self._top(v[n]), reverse=True)
        for i, n in enumerate(nums):
            # ordered by rank, the first block (the layer that moved most) is open
            opened = bool(self.query) or (self.rank is not None and i == 0)
            node = group.add(self._group_label(n, v[n]), expand=opened)
            self._later(node, self._items(v[n]) if self._lazy else [],
                        lambda node=node, w=v[n]: self._add(node, w, expand))
