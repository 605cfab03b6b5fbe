"""The parameter tree: tensors grouped by their dotted names, numeric groups (layers) sorted
numerically and labelled ``layers.0..27``; a fuzzy filter narrows it. For a checkpoint whose
reader renamed tensors (Megatron), it can group them under the names they come from instead."""

from __future__ import annotations

from textual.widgets import Tree

from core import TensorInfo
from core.plan import natural_key
from tui.format import human_bytes, human_count


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


class ParamTree(Tree[TensorInfo]):
    """A ``Tree`` whose leaves carry :class:`TensorInfo` as data."""

    def __init__(self, tensors: dict[str, TensorInfo], **kw):
        super().__init__("parameters", **kw)
        self.tensors = tensors
        self.query = ""
        self.by_source = False
        self.show_root = False

    def on_mount(self) -> None:
        self.rebuild()

    def set_filter(self, query: str) -> None:
        if query == self.query:
            return
        self.query = query
        self.rebuild()

    def set_by_source(self, on: bool) -> None:
        """Group by the names the tensors come from (``TensorInfo.source``, e.g. Megatron's),
        each source listing the Hugging Face tensors cut from it; or by their own names."""
        if on != self.by_source:
            self.by_source = on
            self.rebuild()

    def _key(self, name: str) -> list[str]:
        """The path of a tensor's leaf in the tree."""
        t = self.tensors[name]
        if self.by_source and t.source:
            return t.source.split(".") + [name]
        return name.split(".")

    def first_leaf(self):
        """The first tensor node in display order, or None."""
        stack = [self.root]
        while stack:
            node = stack.pop(0)
            if node.data is not None:
                return node
            stack[:0] = list(node.children)
        return None

    def rebuild(self) -> None:
        self.clear()
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
        self._add(self.root, nested, expand=bool(self.query) or len(names) < 40)
        self.root.expand()

    def _add(self, parent, tree: dict, expand: bool) -> None:
        for k, v in tree.items():
            if isinstance(v, TensorInfo):
                label = (f"{k}  [b]{list(v.shape)}[/] {v.dtype} {v.placement} "
                         f"[dim]{human_count(v.numel)} el, {human_bytes(v.nbytes)}[/]")
                parent.add_leaf(label, data=v)
                continue
            nums = sorted((n for n in v if n.isdigit()), key=int)
            if len(nums) > 1 and len(nums) == len(v):
                # a stack of numbered blocks (layers, experts): one node "layers.0..27"
                group = parent.add(f"{k}.{nums[0]}..{nums[-1]}", expand=expand)
                for n in nums:
                    self._add(group.add(n, expand=bool(self.query)), v[n], expand)
            else:
                self._add(parent.add(k, expand=expand), v, expand)
