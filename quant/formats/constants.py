"""Format facts as named constants, free of torch so planning and the CLI load in a blink.

MX (OCP microscaling): 32 consecutive values along a Linear weight's ``in`` dimension share one
power-of-two scale ``2^e``, stored as the E8M0 byte ``e + 127``; each element is a small float
(``ElementFormat``). Block FP8 (DeepSeek-V3 style): e4m3 values, one float32 ``scale_inv`` per
128x128 tile.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

BLOCK = 32  # MX values sharing one scale
SCALE_BIAS = 127  # E8M0: the stored byte is e + 127
FP8_TILE = 128  # block FP8: one scale per 128x128 tile
E4M3_MAX = 448.0


class ScaleRule(str, enum.Enum):
    """How the shared exponent ``e`` of a block follows from its largest magnitude ``amax``
    (``emax`` is the element format's largest exponent, 2 for E2M1):

    - ``even`` (Quark's default): ``floor(log2(amax)) - emax`` after rounding ``amax`` up to the
      next power of two when its mantissa would round past the element's top (>= 1.75 for E2M1).
      Implemented as ``exponent(amax_bits + 2^(23 - mbits - 1)) - emax`` on the fp32 bit pattern;
      a carry into the all-ones exponent field means +inf, which Quark clamps to 127.
    - ``floor`` (plain OCP): ``floor(log2(amax)) - emax``; ``ceil``: ``ceil(log2(amax)) - emax``.
      Quark takes this ``log2`` in the weight's own dtype: bf16 rounds it to 8 significant bits,
      so e.g. log2 = -57.05 becomes -57.0 and floors to -57 (plain math says -58); an all-zero
      block gets float32 eps = 2^-23 as its scale.
    ``e`` is clamped to [-127, 127]; the stored byte is ``e + 127`` but at least 1.
    """

    EVEN = "even"
    FLOOR = "floor"
    CEIL = "ceil"


@dataclass(frozen=True)
class ElementFormat:
    name: str  # Quark's dtype name
    ebits: int
    mbits: int

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    @property
    def emax(self) -> int:
        return (1 << self.ebits) - 1 - self.bias

    @property
    def min_exp(self) -> int:  # exponent of the smallest normal
        return 1 - self.bias

    @property
    def max(self) -> float:
        return 2.0 ** self.emax * (2 - 2.0 ** -self.mbits)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


E2M1 = ElementFormat("fp4", 2, 1)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; 8..15 add the sign bit (bit 3)
E2M3 = ElementFormat("fp6_e2m3", 2, 3)
E3M2 = ElementFormat("fp6_e3m2", 3, 2)
