"""xeonsd_wheel_markers: the ml_stack role's marker of each controller-built wheel installed in the env.

One marker per wheel name, ``<env>/.<name>-<id>`` holding ``"<wheel file> (<source key>)"``: the wheel is installed
where its marker is missing, and markers of other ids are removed, so going back to an earlier source installs it
again. ``wheels`` is the wheelhouse role's ``wheelhouse_wheels_built`` ({name: {id, file, key, node, ...}}).
"""

from __future__ import annotations

from collections.abc import Mapping


def wheel_markers(wheels: Mapping, env_prefix: str) -> list[dict]:
    """``[{name, path, content, mode, node}]``, one per wheel: what xeonsd_files writes, and the wheel's node path."""
    if not isinstance(wheels, Mapping):
        raise TypeError(f"xeonsd_wheel_markers: expected wheelhouse_wheels_built (a dict), got {wheels!r}")
    out = []
    for name, wheel in wheels.items():
        missing = [k for k in ("id", "file", "key", "node") if k not in wheel]
        if missing:
            raise ValueError(f"xeonsd_wheel_markers: the wheel {name} has no {', '.join(missing)}: {wheel!r}")
        out.append(
            {
                "name": name,
                "path": f"{env_prefix.rstrip('/')}/.{name}-{wheel['id']}",
                "content": f"{wheel['file']} ({wheel['key']})\n",
                "mode": "0644",
                "node": wheel["node"],
            }
        )
    return out


class FilterModule:
    def filters(self) -> dict:
        return {"xeonsd_wheel_markers": wheel_markers}
