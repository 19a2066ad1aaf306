"""Finding the matmuls next to a collective.

Consumers: the ``mm``/``addmm`` nodes whose left operand is a collective's result, reached through
reshapes that flatten its leading dims (``[B, S, K] -> [B*S, K]``).
Producers: the ``mm``/``addmm`` nodes whose sum feeds a collective, through reshapes and ``add``.
Where the caller allows it (``scaled=True``), a matmul may also be ``aten._scaled_mm`` (fp8: torchao's float8
training and fp8 serving layers), as long as all of one site's matmuls are scaled alike (one ``Scaling``): the
fused ops' scaling arguments (ops.py, "Scaled matmuls").
Each finder returns what it found or the reason it found nothing fusable, for the rewrite report.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Node

from .graph_utils import aten, dtype, is_call, is_dtype_change, is_reshape, op_name, shape, val

MATMULS = (aten.mm.default, aten.addmm.default)  # the matmuls the patterns fuse
SCALED_MM = aten._scaled_mm.default  # fused where the pattern allows scaled matmuls
_SCALED_MM_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")


@dataclasses.dataclass(frozen=True)
class Scaling:
    """What the scaled matmuls of one site share: ``_scaled_mm``'s ``out_dtype`` and ``use_fast_accum``."""

    out_dtype: torch.dtype | None
    use_fast_accum: bool

    def kwargs(self) -> dict[str, object]:
        return {"out_dtype": self.out_dtype, "use_fast_accum": self.use_fast_accum}


def scaled_mm_args(node: Node) -> dict[str, object]:
    """The arguments of an ``aten._scaled_mm`` node by name, defaults filled in."""
    args = dict.fromkeys(_SCALED_MM_ARGS)
    args["use_fast_accum"] = False
    args.update(zip(_SCALED_MM_ARGS, node.args))
    args.update(node.kwargs)
    return args


def same_value(x: object, y: object, depth: int = 4) -> bool:
    """Whether ``x`` and ``y`` are the same value: the same node, or the same op of the same arguments (within
    ``depth`` levels): each of torchao's float8 linears takes the reciprocal of the one scale of their shared input."""
    if x is y:
        return True
    if not (isinstance(x, Node) and isinstance(y, Node)) or depth == 0:
        return x == y if not isinstance(x, Node) and not isinstance(y, Node) else False
    if x.op != "call_function" or y.op != "call_function" or x.target != y.target or x.kwargs != y.kwargs:
        return False
    if len(x.args) != len(y.args):
        return False
    return all(same_value(a, b, depth - 1) for a, b in zip(x.args, y.args))


def _one_element(node: object) -> bool:
    v = val(node) if isinstance(node, Node) else None
    return isinstance(v, torch.Tensor) and v.numel() == 1


@dataclasses.dataclass
class ConsumerMatmul:
    """``out = A2 @ b (+ bias)`` where ``A2`` is the collective's result flattened to 2-D; scaled (``_scaled_mm``)
    where ``scale_b`` is given: ``scale_a`` is A2's (one element), ``scale_b`` the weight's."""

    node: Node
    b: Node
    bias: Node | None
    scale_a: Node | None = None
    scale_b: Node | None = None


@dataclasses.dataclass
class Consumers:
    matmuls: list[ConsumerMatmul]
    # Users of the collective's result that are not fusable matmuls, with why (they keep the result).
    others: list[tuple[Node, str]]
    scaling: Scaling | None = None  # the matmuls are scaled alike (None: plain mm/addmm)

    def scaling_kwargs(self) -> dict[str, object]:
        """The fused consumer op's scaling arguments (none for plain matmuls)."""
        if self.scaling is None:
            return {}
        return {
            "A_scale": self.matmuls[0].scale_a,
            "B_scales": [mm.scale_b for mm in self.matmuls],
            **self.scaling.kwargs(),
        }


def _default_addmm(node: Node) -> bool:
    return node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1


def find_consumers(result: Node, scaled: bool = False) -> Consumers:
    """Matmuls consuming ``result`` (N-D, last dim K) as their left operand, possibly after reshapes; with
    ``scaled``, also ``_scaled_mm`` nodes with one A scale (all of them scaled alike: the first kind found is
    fused, the others keep the result)."""
    rshape = shape(result)
    found = Consumers([], [])
    if rshape is None or len(rshape) < 2:
        return found
    k = rshape[-1]
    seen: set[Node] = set()
    # The fused op runs where the collective was: a weight or bias computed from the result cannot feed it.
    downstream = _descendants(result)

    def visit(node: Node) -> None:
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            ushape = shape(user)
            if is_call(user, *MATMULS) and found.scaling is not None:
                found.others.append((user, f"{user.name} is not scaled like {found.matmuls[0].node.name}"))
                continue
            if is_call(user, aten.mm.default) and user.args[0] is node and user.args[1] not in downstream:
                if len(shape(node) or ()) == 2:
                    found.matmuls.append(ConsumerMatmul(user, user.args[1], None))
                    continue
            elif (
                is_call(user, aten.addmm.default)
                and user.args[1] is node
                and user.args[2] not in downstream
                and user.args[0] not in downstream
            ):
                if not _default_addmm(user):
                    found.others.append((user, "addmm with beta/alpha != 1"))
                    continue
                found.matmuls.append(ConsumerMatmul(user, user.args[2], user.args[0]))
                continue
            elif is_call(user, SCALED_MM) and scaled and user.args[0] is node and len(shape(node) or ()) == 2:
                why = _scaled_consumer(user, downstream, found)
                if why is None:
                    continue
                found.others.append((user, why))
                continue
            elif is_reshape(user) and user.args[0] is node and ushape and len(ushape) >= 2 and ushape[-1] == k:
                visit(user)
                continue
            found.others.append((user, _other_reason(user, node)))

    visit(result)
    return found


def _scaled_consumer(node: Node, downstream: set[Node], found: Consumers) -> str | None:
    """Adds the ``_scaled_mm`` ``node`` to ``found`` when it fuses alike with the matmuls found so far, else why not."""
    a = scaled_mm_args(node)
    if a["scale_result"] is not None:
        return f"{node.name} has a result scale (fp8 output)"
    if any(x in downstream for x in (a["mat2"], a["scale_a"], a["scale_b"], a["bias"])):
        return f"{node.name}'s weight, scales or bias are computed from the collective's result"
    if not _one_element(a["scale_a"]):
        return (
            f"{node.name} scales the communicated rows row-wise with a scale computed after the collective "
            "(quantized after it)"
        )
    scaling = Scaling(a["out_dtype"], bool(a["use_fast_accum"]))
    if found.matmuls and (found.scaling != scaling or not same_value(found.matmuls[0].scale_a, a["scale_a"])):
        first = found.matmuls[0].node.name
        return f"{node.name} is scaled differently from {first} (scale, out_dtype or fast accumulation)"
    found.scaling = scaling
    found.matmuls.append(ConsumerMatmul(node, a["mat2"], a["bias"], a["scale_a"], a["scale_b"]))
    return None


def _descendants(node: Node) -> set[Node]:
    """``node`` and every node computed from it."""
    found = {node}
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in found:
                found.add(user)
                stack.append(user)
    return found


def _other_reason(user: Node, node: Node) -> str:
    if is_call(user, *MATMULS) and node is user.args[-2]:
        return f"{user.name}'s right operand or bias is computed from the collective's result"
    if is_call(user, *MATMULS):
        return f"{user.name} takes it as the right operand (contraction over the collective's dim)"
    if is_dtype_change(user):
        return f"dtype change {dtype(node)} -> {user.args[1]} in {user.name}"
    return f"{op_name(user)} ({user.name}) uses it"


@dataclasses.dataclass
class ProducerTerm:
    """One ``a @ b (+ bias)`` of a sum of matmuls; scaled (``_scaled_mm``) where ``scale_b`` is given."""

    node: Node
    a: Node
    b: Node
    bias: Node | None
    scale_a: Node | None = None
    scale_b: Node | None = None


@dataclasses.dataclass
class Producers:
    terms: list[ProducerTerm]  # the term with a bias first, then graph order of the add tree
    chain: list[Node]  # the reshapes and adds between the matmuls and the collective (erased on rewrite)
    scaling: Scaling | None = None  # the terms are scaled alike (None: plain mm/addmm)

    @property
    def bias(self) -> Node | None:
        return self.terms[0].bias

    def scaling_kwargs(self) -> dict[str, object]:
        """The fused producer op's scaling arguments (none for plain matmuls)."""
        if self.scaling is None:
            return {}
        return {
            "A_scales": [t.scale_a for t in self.terms],
            "B_scales": [t.scale_b for t in self.terms],
            **self.scaling.kwargs(),
        }


def find_producers(start: Node, collective: str, scaled: bool = False) -> Producers | str:
    """The sum of matmuls that ``start`` (the collective's input) is made of, or why there is none; with
    ``scaled``, its terms may be ``_scaled_mm`` nodes, all scaled alike.

    Every node on the way must have ``start``'s chain as its only user, otherwise the intermediate value
    is needed elsewhere and fusing would compute it twice. Where the chain also holds something other than
    matmuls, reshapes and adds, that is the reason given: no rewiring of users could fuse it.
    """
    terms: list[ProducerTerm] = []
    chain: list[Node] = []
    out_dtype = dtype(start)
    shared: list[str] = []  # the first node on the way that has other users, as the report names it
    seen: set[Node] = set()
    scalings: list[Scaling | None] = []  # per term

    def visit(node: Node) -> str | None:
        if not isinstance(node, Node):
            return f"{node!r} is not a tensor produced in the graph"
        if shared and node in seen:
            return None  # already walked; the match fails anyway (a shared node)
        seen.add(node)
        if len(node.users) != 1 and not shared:
            what = "mm result" if is_call(node, *MATMULS) else node.name
            shared.append(f"{what} ({node.name}) has {len(node.users)} users")
        if dtype(node) != out_dtype:
            return f"dtype change {dtype(node)} -> {out_dtype} between mm and {collective}"
        if is_call(node, aten.mm.default):
            terms.append(ProducerTerm(node, node.args[0], node.args[1], None))
            scalings.append(None)
            return None
        if is_call(node, aten.addmm.default):
            if not _default_addmm(node):
                return f"addmm with beta/alpha != 1 ({node.name})"
            terms.append(ProducerTerm(node, node.args[1], node.args[2], node.args[0]))
            scalings.append(None)
            return None
        if is_call(node, SCALED_MM) and scaled:
            a = scaled_mm_args(node)
            if a["scale_result"] is not None:
                return f"{node.name} has a result scale (fp8 output) before the {collective}"
            terms.append(ProducerTerm(node, a["self"], a["mat2"], a["bias"], a["scale_a"], a["scale_b"]))
            scalings.append(Scaling(a["out_dtype"], bool(a["use_fast_accum"])))
            return None
        if is_reshape(node):
            chain.append(node)
            return visit(node.args[0])
        if is_call(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2:
            lhs, rhs = node.args
            if not (isinstance(lhs, Node) and isinstance(rhs, Node)) or shape(lhs) != shape(rhs):
                return f"add with broadcasting or a scalar ({node.name}) between mm and {collective}"
            chain.append(node)
            return visit(lhs) or visit(rhs)
        if is_call(node, SCALED_MM):
            return f"{node.name} is a scaled matmul (fp8), which the {collective} pattern does not fuse"
        src = node
        while is_call(src, operator.getitem):
            src = src.args[0]
        if src is not node and is_call(src, *_fused_targets()):
            return f"its matmul is already fused into {op_name(src)}"
        if matmul_ancestor(node) is None:
            return f"{op_name(node)} ({node.name}) feeds the {collective}, not a matmul"
        return f"{op_name(node)} ({node.name}) between mm and {collective}"

    why = visit(start) or (shared[0] if shared else None)
    if why:
        return why
    if not terms:
        return f"no mm feeds the {collective}"
    if any(s != scalings[0] for s in scalings[1:]):
        return f"matmuls scaled differently (or scaled and plain) summed before the {collective}"
    with_bias = [t for t in terms if t.bias is not None]
    if len(with_bias) > 1:
        return f"{len(with_bias)} addmm biases in one sum"
    # Shapes may hold SymInts (dynamic shapes), which do not hash: compare, don't collect in a set.
    mshape = shape(terms[0].node)
    if any(shape(t.node) != mshape for t in terms[1:]):
        return f"matmuls of different shapes {[str(shape(t.node)) for t in terms]} summed"
    sshape = shape(start)
    if sshape is None or mshape is None or sshape[-1] != mshape[-1]:
        return f"reshape between mm {mshape} and {collective} input {sshape} changes the last dim"
    if any(val(t.a) is None or val(t.b) is None for t in terms):
        return "operands without example values"
    terms.sort(key=lambda t: t.bias is None)
    return Producers(terms, chain, scalings[0])


def matmul_ancestor(node: Node, limit: int = 64) -> Node | None:
    """The first mm/addmm/_scaled_mm found among the (nearest ``limit``) nodes ``node`` is computed from, or None."""
    stack, seen = [node], {node}
    while stack and len(seen) <= limit:
        for a in stack.pop().all_input_nodes:
            if is_call(a, *MATMULS, SCALED_MM):
                return a
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return None


def scaled_descendant(node: Node, limit: int = 32) -> Node | None:
    """The first ``_scaled_mm`` that takes, as its left operand, a tensor computed from ``node`` through a
    conversion to fp8 (among the nearest ``limit`` nodes computed from it), or None: ``node`` is quantized on the
    way to a scaled matmul."""
    stack, seen = [node], {node}
    while stack and len(seen) <= limit:
        for user in stack.pop().users:
            if is_call(user, SCALED_MM) and user.args[0] is not node:
                return user
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return None


def _fused_targets() -> tuple:
    from .. import ops

    return tuple(ops.op(name) for name in ops.FUSED_OPS)
