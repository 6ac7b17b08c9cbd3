"""Exceptions of the sparsebalance package.

Every C++ call that fails raises one of these with the gRPC status code of the failure::

    try:
        client.submit_batch(step, batch)
    except sparsebalance.PlannerError as e:
        if e.code == "INVALID_ARGUMENT":      # e.code is a StatusCode (a str enum)
            print(e.message)                  # names the field, e.g. "samples[3].length ..."
        elif e.unreachable:                   # UNAVAILABLE or DEADLINE_EXCEEDED
            ...

This module has no dependency on the compiled extension: sparsebalance._C imports it to raise.
"""

import enum

__all__ = ["StatusCode", "Error", "PlannerError", "KernelError"]


class StatusCode(str, enum.Enum):
    """gRPC (and absl) status codes. Members compare equal to their names ("NOT_FOUND");
    `.number` is the wire number (int(code) works too)."""

    OK = "OK"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"

    @property
    def number(self):
        return _NUMBERS[self]

    def __int__(self):
        return self.number

    def __str__(self):
        return self.value

    @classmethod
    def from_number(cls, number):
        try:
            return list(cls)[int(number)]
        except IndexError:
            return cls.UNKNOWN


_NUMBERS = {code: number for number, code in enumerate(StatusCode)}


class Error(Exception):
    """A failed SparseBalance call: `code` (StatusCode), `code_number` (int) and `message`."""

    def __init__(self, code, message):
        self.code = code if isinstance(code, StatusCode) else StatusCode.from_number(code)
        self.message = str(message)
        super().__init__(f"{self.code.value}: {self.message}")

    @property
    def code_number(self):
        return self.code.number

    @property
    def unreachable(self):
        """True when the planner could not be reached (UNAVAILABLE, DEADLINE_EXCEEDED)."""
        return self.code in (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED)

    def __reduce__(self):
        return (type(self), (self.code.number, self.message))


class PlannerError(Error):
    """Raised by PlannerClient, TrainerSession and the plan functions (codes as DESIGN.md
    section 6: INVALID_ARGUMENT names the field, NOT_FOUND an unknown job,
    FAILED_PRECONDITION a step out of order, UNAUTHENTICATED/PERMISSION_DENIED a token, ...)."""


class KernelError(Error):
    """Raised by block selection and the attention kernels (bad shapes, sizes, densities)."""
