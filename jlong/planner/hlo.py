"""The text of a compiled XLA program (`compiled.as_text()`), read into
computations of instructions: enough structure to count what a step runs.

Only what the step cost needs is kept per instruction: its name, opcode,
result arrays (with their memory space: `S(5)` is host memory), operand
names, the computations it calls and its raw attributes, from which
`backend_config` (JSON), `replica_groups` and `source_target_pairs` are read
on demand. Instructions keep their order, which after XLA's scheduling
pass is the order a device runs them in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

import numpy as np

# Bytes per element of XLA's primitive types. XLA:GPU packs the 4-bit types two
# to a byte (their layouts say `E(4)`): a QLoRA base's codes are half a byte each.
_ITEMSIZE = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0,
}
HOST_MEMORY_SPACE = "S(5)"

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9-]*)\(")
_OPERAND = re.compile(r"%([^\s,()]+)")
_COMPUTATION_NAME = re.compile(r"%([^\s(),{}]+)")  # in a list too: branch_computations={%a, %b}


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    on_host: bool

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return math.ceil(self.elements * _ITEMSIZE.get(self.dtype, 4))


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    arrays: tuple[Array, ...]  # the result's arrays (a tuple's leaves, in order)
    operands: tuple[str, ...]
    called: tuple[str, ...]  # computations it calls (fused body, loop body and condition, branches, reducer)
    attributes: str
    parameter_number: int | None = None  # k of `parameter(k)`

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.arrays)

    @functools.cached_property
    def backend_config(self) -> dict:
        text = _braced_after(self.attributes, "backend_config=")
        if not text:
            return {}
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {}

    def attribute(self, key: str) -> str | None:
        """The raw value of `key=` (a braced value whole)."""
        start = self.attributes.find(f"{key}=")
        if start < 0:
            return None
        rest = self.attributes[start + len(key) + 1:]
        if rest.startswith("{"):
            return _braced_after(self.attributes, f"{key}=")
        return re.split(r",\s", rest, maxsplit=1)[0]

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.attribute(key) or ""
        return tuple(int(v) for v in re.findall(r"-?\d+", value))

    @property
    def known_trip_count(self) -> int | None:
        count = self.backend_config.get("known_trip_count", {}).get("n")
        return int(count) if count is not None else None

    def device_groups(self, num_devices: int) -> list[list[int]]:
        """The groups of devices a collective runs over (`replica_groups`, in
        either of XLA's two forms); one group of all devices when empty."""
        groups = self.attribute("replica_groups")
        if groups is None or groups.strip("{} ") == "":
            return [list(range(num_devices))]
        if groups.startswith("["):
            return _iota_groups(groups)
        if groups.startswith("mesh["):
            return _mesh_axes_groups(self.attributes[self.attributes.find("replica_groups=mesh[") + 15:])
        return [[int(v) for v in re.findall(r"\d+", g)] for g in re.findall(r"\{([^{}]*)\}", groups)]

    def source_target_pairs(self) -> list[tuple[int, int]]:
        values = [int(v) for v in re.findall(r"\d+", self.attribute("source_target_pairs") or "")]
        return list(zip(values[::2], values[1::2]))


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list[Instruction]
    _root: str | None = None

    @functools.cached_property
    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    @functools.cached_property
    def parameters(self) -> list[Instruction]:
        """The computation's parameters by number."""
        return sorted((i for i in self.instructions if i.opcode == "parameter"), key=lambda i: i.parameter_number)

    @functools.cached_property
    def users(self) -> dict[str, list[Instruction]]:
        users: dict[str, list[Instruction]] = {}
        for instruction in self.instructions:
            for operand in instruction.operands:
                users.setdefault(operand, []).append(instruction)
        return users

    @property
    def root(self) -> Instruction:
        return self.instructions[-1] if self._root is None else self.by_name[self._root]

    def operand_arrays(self, instruction: Instruction) -> list[Array]:
        """The arrays of an instruction's operands, in order (operands are names in this computation)."""
        return [a for name in instruction.operands if name in self.by_name for a in self.by_name[name].arrays]


@dataclasses.dataclass
class HloModule:
    computations: dict[str, Computation]
    entry: str

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


def parse_module(text: str) -> HloModule:
    """An HLO module's text -> its computations, in program order."""
    computations: dict[str, Computation] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            stripped = line.strip()
            if stripped.endswith("{") and (stripped.startswith("%") or stripped.startswith("ENTRY")):
                name = _COMPUTATION_NAME.search(stripped).group(1)
                current = Computation(name, [])
                if stripped.startswith("ENTRY"):
                    entry = name
            continue
        if line.startswith("}"):
            computations[current.name] = current
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            current.instructions.append(instruction)
            if line.lstrip().startswith("ROOT "):
                current._root = instruction.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(computations, entry)


def parse_instruction(line: str) -> Instruction | None:
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    name, rest = head.group(2), line[head.end():]
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
        type_text, rest = rest[: end + 1], rest[end + 1:]
    else:
        type_text, _, rest = rest.partition(" ")
        rest = " " + rest
    opcode_match = _OPCODE.match(rest)
    if opcode_match is None:
        return None
    open_paren = opcode_match.end() - 1
    close = _matching(rest, open_paren, "(", ")")
    operand_text, attributes = rest[open_paren + 1: close], rest[close + 1:].lstrip(", ")
    arrays = tuple(
        Array(dtype, tuple(int(d) for d in dims.split(",") if d), HOST_MEMORY_SPACE in (layout or ""))
        for dtype, dims, layout in _ARRAY.findall(type_text)
    )
    return Instruction(
        name=name,
        opcode=opcode_match.group(1),
        arrays=arrays,
        operands=tuple(_OPERAND.findall(operand_text)),
        called=_called_computations(attributes),
        attributes=attributes,
        parameter_number=int(operand_text) if opcode_match.group(1) == "parameter" else None,
    )


def _called_computations(attributes: str) -> tuple[str, ...]:
    names = []
    for key in ("calls", "body", "condition", "to_apply", "branch_computations", "true_computation",
                "false_computation"):
        start = attributes.find(f"{key}=")
        if start < 0 or (start > 0 and attributes[start - 1] not in " ,"):
            continue
        value = attributes[start + len(key) + 1:]
        if value.startswith("{"):
            value = value[: _matching(value, 0, "{", "}") + 1]
        else:
            value = value.split(",", 1)[0]  # names hold no commas; the next attribute may follow with no space
        names += _COMPUTATION_NAME.findall(value)
    return tuple(names)


def _matching(text: str, start: int, open_char: str, close_char: str) -> int:
    """The index of the bracket that closes the one at `start`, not counting
    brackets inside quoted strings (a Triton call's kernel is one)."""
    depth, index, quoted = 0, start, False
    while index < len(text):
        char = text[index]
        if quoted:
            if char == "\\":
                index += 1  # the escaped character
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char == open_char:
            depth += 1
        elif char == close_char:
            depth -= 1
            if depth == 0:
                return index
        index += 1
    raise ValueError(f"unbalanced {open_char}{close_char} in HLO text: {text[start:start + 80]!r}")


def _braced_after(text: str, key: str) -> str | None:
    start = text.find(key)
    if start < 0:
        return None
    start += len(key)
    if start >= len(text) or text[start] != "{":
        return None
    return text[start: _matching(text, start, "{", "}") + 1]


def _mesh_axes_groups(text: str) -> list[list[int]]:
    """`mesh['a'=1,'b'=8] {'b'}`: devices numbered row-major over the named
    axes; a group for each position on the other axes, spanning the listed ones."""
    match = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
    axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
    names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
    spanned = [names.index(name) for name in re.findall(r"'([^']+)'", match.group(2))]
    kept = [axis for axis in range(len(names)) if axis not in spanned]
    ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(kept + spanned)
    return ids.reshape(-1, math.prod(sizes[axis] for axis in spanned)).tolist()


def _iota_groups(text: str) -> list[list[int]]:
    """`[G,N]<=[d0,d1,...]T(p0,p1,...)`: iota over the dims, transposed, reshaped to G groups of N."""
    match = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    shape = [int(v) for v in match.group(1).split(",")]
    dims = [int(v) for v in match.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match.group(3):
        ids = ids.transpose([int(v) for v in match.group(3).split(",")])
    return ids.reshape(shape[0], -1).tolist()
