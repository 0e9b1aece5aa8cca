"""Per-device memory of a compiled program, from its memory analysis and HLO."""

import dataclasses

from .hlo import host_buffers


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """Per-device bytes from `compiled.memory_analysis()`, in device memory and in
    (pinned) host memory."""

    argument: int
    output: int
    temp: int
    alias: int
    host_argument: int = 0
    host_output: int = 0
    host_temp: int = 0
    host_alias: int = 0
    host_moved: int = 0
    """Bytes one execution moves between device and host: host arguments read,
    host outputs written, and each program-allocated host buffer (offloaded
    activations) written once and read once."""

    @property
    def total(self) -> int:
        """Peak live device bytes: arguments + outputs + temporaries - donated (aliased) outputs."""
        return self.argument + self.output + self.temp - self.alias

    @property
    def host_total(self) -> int:
        """The same in host memory (offloaded activations, host-resident state)."""
        return self.host_argument + self.host_output + self.host_temp - self.host_alias

    @classmethod
    def of(cls, compiled) -> "MemoryFigures":
        m = compiled.memory_analysis()
        moved = m.host_argument_size_in_bytes + m.host_output_size_in_bytes + 2 * sum(host_buffers(compiled.as_text()))
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes, m.alias_size_in_bytes,
                   m.host_argument_size_in_bytes, m.host_output_size_in_bytes, m.host_temp_size_in_bytes,
                   m.host_alias_size_in_bytes, moved)
