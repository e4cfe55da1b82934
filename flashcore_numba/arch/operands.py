"""The operands the PTX functions of `ptx/` take, each with its simulator version.

A PTX function (arch/ptx.py: `function`) takes plain integers and floats. What a kernel has is
arrays; this module turns them into what the PTX expects:

- shared and global addresses (`shared_address`, `global_address`: `cvta.to.shared` and
  `cvta.to.global` of an array's first element) and a tensor map's address (`map_address`);
- wgmma's 64-bit shared-memory matrix descriptors (`matrix_descriptor`, `SWIZZLE_128B`);
- small local arrays passed as register tuples (`as_tuple`, `store_tuple`: the tuples route).

In Numba's simulator there is no PTX: an address is a `Pointer` (an array and a byte offset),
a descriptor a `Descriptor`, and a tuple a plain Python tuple, which the emulations in
`arch/sim_*.py` read and write through.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sim import simulator_enabled


# ---------------------------------------------------------------------------------------------
# Shared-memory addresses
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pointer:
    """The simulator's address: an array (shared or global) and a byte offset into it."""

    array: object
    offset: int = 0

    def __add__(self, nbytes):
        return Pointer(self.array, self.offset + int(nbytes))

    __radd__ = __add__

    def __xor__(self, nbytes):
        """The offset's bits flipped (a swizzled address). XOR of the offset is XOR of the address
        on a GPU because the tiles a kernel swizzles start at multiples of their rows' length
        (phase 11's layout asserts it), and the array here starts at offset 0."""
        return Pointer(self.array, self.offset ^ int(nbytes))

    def __sub__(self, other):
        """A pointer `other` bytes back, or the distance in bytes to another pointer (into the same
        memory, through any view of it: each simulated thread has its own view of shared memory)."""
        if isinstance(other, Pointer):
            return self._address() - other._address()
        return Pointer(self.array, self.offset - int(other))

    def _address(self) -> int:
        base = getattr(self.array, "_ary", self.array)
        return base.__array_interface__["data"][0] + self.offset

    def view(self, dtype, rows: int, cols: int, ld: int):
        """A (rows, cols) NumPy view of elements of `dtype`, rows `ld` elements apart."""
        import numpy as np

        dtype = np.dtype(dtype)
        base = getattr(self.array, "_ary", self.array)  # a simulator device array wraps its NumPy array
        return np.ndarray((rows, cols), dtype=dtype, buffer=base, offset=self.offset,
                          strides=(int(ld) * dtype.itemsize, dtype.itemsize))


def _make_address(space: str):
    """`shared_address(array)` (32-bit .shared) or `global_address(array)` (64-bit .global):
    the address of an array's first element in that state space (`cvta.to.<space>`)."""
    if simulator_enabled():
        return Pointer
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    bits = 32 if space == "shared" else 64

    def address(typingctx, array):
        if not isinstance(array, types.Array):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            generic = builder.ptrtoint(data, ir.IntType(64))
            converted = builder.asm(ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                                    f"cvta.to.{space}.u64 $0, $1;", "=l,l", [generic], side_effect=False)
            return builder.trunc(converted, ir.IntType(32)) if bits == 32 else converted

        return (types.uint32 if bits == 32 else types.uint64)(array), codegen

    address.__name__ = f"{space}_address"
    return intrinsic(address)


shared_address = _make_address("shared")  # for WMMA, ldmatrix, cp.async destinations
global_address = _make_address("global")  # for cp.async sources


def _make_map_address():
    """`map_address(tmap)`: the generic 64-bit address of a tensor map's 128 bytes (a device
    array from flashcore_numba.arch.tma.tensor_map), the operand TMA instructions take."""
    if simulator_enabled():
        return lambda tmap: tmap  # the emulation looks the map up by the array itself
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def map_address(typingctx, array):
        if not isinstance(array, types.Array):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            return builder.ptrtoint(data, ir.IntType(64))

        return types.uint64(array), codegen

    return map_address


map_address = _make_map_address()


# ---------------------------------------------------------------------------------------------
# Shared-memory matrix descriptors (wgmma)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Descriptor:
    """The simulator's matrix descriptor: where the tile starts, its LBO and SBO in bytes, and
    its swizzle mode (0 none, 1 the 128-byte swizzle)."""

    pointer: Pointer
    lbo: int
    sbo: int
    swizzle: int = 0


SWIZZLE_128B = 1  # the descriptor's swizzle mode (bits 62-63) for the 128-byte swizzle


def _make_matrix_descriptor():
    if simulator_enabled():
        return Descriptor
    from numba import cuda, uint64

    @cuda.jit(device=True, inline=True)
    def matrix_descriptor(address, lbo, sbo, swizzle):
        """The 64-bit wgmma descriptor of a tile at shared `address` (see ptx/wgmma.ptx): 14-bit
        fields of address, LBO and SBO in 16-byte units, and the swizzle mode in bits 62-63."""
        return (uint64((address >> 4) & 0x3FFF)
                | (uint64((lbo >> 4) & 0x3FFF) << uint64(16))
                | (uint64((sbo >> 4) & 0x3FFF) << uint64(32))
                | (uint64(swizzle) << uint64(62)))

    return matrix_descriptor


matrix_descriptor = _make_matrix_descriptor()


# ---------------------------------------------------------------------------------------------
# Register arrays as tuples (the tuples route)
# ---------------------------------------------------------------------------------------------
# A kernel keeps its fragments in small local arrays (acc[j, e], p_frag[kk, e]); LLVM keeps
# them in registers as long as every index is a compile-time constant. A function of the tuples
# route takes them as one tuple: `as_tuple(acc, 64)` reads the first 64 elements (in C order)
# at constant indices, `store_tuple(acc, values)` writes a returned tuple back the same way.
# Both take C-contiguous arrays only (any other does not type: the elements are read by offset).
# Spelled out in Python, either would be a loop with a run-time index, and the array would be
# put in local memory.
def _flat(array):
    return getattr(array, "_ary", array).reshape(-1)  # a C-ordered view (local arrays are C-contiguous)


def _make_tuple_helpers():
    if simulator_enabled():
        def as_tuple(array, n):
            return tuple(_flat(array)[:n])

        def store_tuple(array, values):
            _flat(array)[:len(values)] = values

        return as_tuple, store_tuple
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _element(context, builder, aryty, ary, i):
        data = context.make_array(aryty)(context, builder, ary).data
        return builder.gep(data, [ir.Constant(ir.IntType(64), i)])

    @intrinsic
    def as_tuple(typingctx, array, n):
        if not isinstance(array, types.Array) or array.layout != "C" or not isinstance(n, types.IntegerLiteral):
            return None
        count = n.literal_value

        def codegen(context, builder, signature, args):
            values = [builder.load(_element(context, builder, signature.args[0], args[0], i)) for i in range(count)]
            return context.make_tuple(builder, signature.return_type, values)

        return types.UniTuple(array.dtype, count)(array, n), codegen

    @intrinsic
    def store_tuple(typingctx, array, values):
        if not isinstance(array, types.Array) or array.layout != "C" or not isinstance(values, types.UniTuple) \
                or values.dtype != array.dtype:
            return None

        def codegen(context, builder, signature, args):
            for i in range(signature.args[1].count):
                builder.store(builder.extract_value(args[1], i),
                              _element(context, builder, signature.args[0], args[0], i))
            return context.get_dummy_value()

        return types.none(array, values), codegen

    return as_tuple, store_tuple


as_tuple, store_tuple = _make_tuple_helpers()
