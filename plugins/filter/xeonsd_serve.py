"""The serve and serve_frontend roles' logic (serve.yml): what to serve, its command line, the files every node
needs, and what HAProxy's statistics say of each node.

What is served is xeonsd's contract (train/src/xeonsd/contracts/serve_plan.py, standard library only), which this
plugin imports from the controller's venv:

    "{{ serve_run | xeonsd_serve_run_dir(runs_dir) }}": the run's directory (latest, a name, or a path)
    "{{ serve_adapters | xeonsd_serve_adapter_runs(serve_lora_alpha) }}": [{name, run, alpha}]
    "{{ slurped.results | xeonsd_serve_inference_model(serve_inference_model) }}": the pipeline served in place of
        the base model ('' none)
    "{{ slurped.results | xeonsd_serve_plan(adapter_runs, export_dir, alpha, blends, inference_model, index) }}":
        {export, adapters, …}
    "{{ plan | xeonsd_serve_argv(settings) }}": ["serve", EXPORT, "--adapter", …, "--port", …]
    "{{ found | xeonsd_serve_files(stats) }}": {absolute path: sha1} of an export's find and the adapters' stats
    "{{ node_files | xeonsd_serve_files_to_pull(expected) }}": the paths a node lacks or holds changed
    "{{ csv | xeonsd_haproxy_servers(backend) }}": {server: status} of HAProxy's CSV statistics
    "{{ serve_api_keys | xeonsd_serve_key_file }}": the --api-key-file text (NAME:KEY lines) of [{name, key}]
    "{{ serve_api_keys | xeonsd_serve_key_problem }}": what is wrong with them ('' when nothing), keys unsaid
    "{{ serve_allow_from | xeonsd_serve_allow_from }}": the --allow-from value (CIDR,CIDR) of a list of networks
"""

from __future__ import annotations

import base64
import csv
import io
import ipaddress
import json
from collections.abc import Mapping, Sequence
from typing import Any

from xeonsd import families

# xeonsd's standard-library-only parts, from the controller's venv (`make install`: see plugins/README.md).
from xeonsd.contracts import serve_plan
from xeonsd.serve import keys as serve_keys

ServePlanError = serve_plan.ServePlanError
serve_argv = serve_plan.serve_argv


def _run(result: Mapping[str, Any]) -> dict[str, Any]:
    """``{dir, summary}`` of one item of the serve role's slurp loop over the runs' stat results."""
    st = result["item"]["stat"]
    try:
        summary = json.loads(base64.b64decode(result["content"]))
    except (KeyError, ValueError) as e:
        raise ServePlanError(f"{result['item']['item']}/train_summary.json cannot be read: {e!r}") from None
    return {"dir": st.get("lnk_source") or result["item"]["item"], "summary": summary}


def inference_model_of(summaries: Sequence[Mapping[str, Any]], given: str = "") -> str:
    """The pipeline a run of a family without an OpenVINO export is served on in place of its base model:
    serve_inference_model (``given``), else the served run's own ``inference_model`` (the first of the serve role's
    slurped summaries); '' where neither names one."""
    return given or str(_run(summaries[0])["summary"].get("inference_model") or "")


def serve_plan_of(
    summaries: Sequence[Mapping[str, Any]],
    adapters: Sequence[Mapping[str, Any]],
    export_dir: str,
    alpha: Any = 1.0,
    blends: Any = (),
    inference_model: str = "",
    inference_index: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan (serve_plan.plan) from the serve role's slurp loop of train_summary.json: the served run's first,
    then serve_adapters' runs in the order of ``adapters`` (xeonsd_serve_adapter_runs); ``blends``: serve_blends;
    ``inference_model``: serve_inference_model, and ``inference_index`` the slurp of model_index.json in it, or in
    the run's own inference_model where that is empty (not found: no ``content``)."""
    if len(summaries) != len(adapters) + 1:
        raise ValueError(f"xeonsd_serve_plan: {len(summaries)} summaries for 1 run and {len(adapters)} adapters")
    runs = [_run(r) for r in summaries]
    named = [{**runs[i + 1], "name": a["name"], "alpha": a["alpha"]} for i, a in enumerate(adapters)]
    try:
        family = families.of_run(runs[0]["summary"], runs[0]["dir"])
    except families.FamilyError as e:
        raise ServePlanError(str(e)) from None
    torch_family = "" if family.ov_pipeline_class else family.label  # no OpenVINO export: the PyTorch engine
    fused = "" if family.genai_adapters or torch_family else family.label
    inference = None
    path = inference_model_of(summaries, inference_model)
    if path:
        try:
            cls = str(json.loads(base64.b64decode((inference_index or {})["content"])).get("_class_name", ""))
        except (KeyError, ValueError):
            cls = ""
        found = families.of_pipeline_class(cls) if cls else None
        pipeline = {"pipeline": cls, "family": found.label if found else ""}
        inference = {"dir": path, "given": bool(inference_model), **pipeline}
    return serve_plan.plan(
        runs[0],
        export_dir,
        named,
        alpha=alpha,
        fused_family=fused,
        blends=blends,
        torch_family=torch_family,
        inference=inference,
    )


def serve_files(found: Sequence[Mapping[str, Any]], stats: Sequence[Mapping[str, Any]] = ()) -> dict[str, str]:
    """``{absolute path: sha1}`` of ``ansible.builtin.find``'s files (``get_checksum: true``) and of the ``stat``
    results of single files (a loop's ``results``: a missing file is left out, so the comparison names it)."""
    if isinstance(found, (str, Mapping)) or not isinstance(found, Sequence):
        raise TypeError(f"xeonsd_serve_files: expected the 'files' list of a find result, got {type(found).__name__}")
    out: dict[str, str] = {}
    for f in found:
        if "checksum" not in f:
            raise ValueError(f"xeonsd_serve_files: {f.get('path', f)} has no checksum (find needs get_checksum: true)")
        out[f["path"]] = f["checksum"]
    for result in stats:
        st = result.get("stat") or {}
        if st.get("exists"):
            if "checksum" not in st:
                raise ValueError(f"xeonsd_serve_files: {st.get('path')} has no checksum (stat needs get_checksum)")
            out[st["path"]] = st["checksum"]
    return dict(sorted(out.items()))


def serve_files_to_pull(node: Mapping[str, str], expected: Mapping[str, str]) -> list[str]:
    """The files of ``expected`` (``{path: sha1}``) that ``node`` lacks or holds with another checksum."""
    return sorted(path for path, sha in expected.items() if node.get(path) != sha)


def haproxy_servers(text: str, backend: str) -> dict[str, str]:
    """``{server: status}`` (UP, DOWN, MAINT, ``UP 1/2``, …) of ``backend`` in HAProxy's CSV statistics (the stats
    page's ``;csv``; its first line starts with ``# ``)."""
    lines = str(text).lstrip("# ").splitlines()
    rows = csv.DictReader(io.StringIO("\n".join(lines)))
    if rows.fieldnames is None or not {"pxname", "svname", "status"} <= set(rows.fieldnames):
        raise ValueError(f"xeonsd_haproxy_servers: not HAProxy's CSV statistics: {str(text)[:120]!r}")
    return {
        r["svname"]: r["status"] for r in rows if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")
    }


def serve_key_file(keys: Any) -> str:
    """The ``xeonsd serve --api-key-file`` text of ``serve_api_keys`` (``[{name, key}]``), checked by the server's
    own rules (:func:`xeonsd.serve.keys.parse_keys`); a message never holds a key."""
    if keys in (None, ""):
        keys = []
    if isinstance(keys, (str, Mapping)) or not isinstance(keys, Sequence):
        raise ServePlanError(
            f"serve_api_keys is a {type(keys).__name__}: it is a list of {{name, key}}, e.g. [{{name: alice, key: "
            "KEY}] with KEY from an Ansible vault. Fix: set it to such a list, or []."
        )
    lines = []
    for number, item in enumerate(keys, 1):
        if not isinstance(item, Mapping) or set(item) != {"name", "key"}:
            what = sorted(item) if isinstance(item, Mapping) else type(item).__name__
            raise ServePlanError(
                f"serve_api_keys item {number} has {what}: each item is {{name, key}} and nothing else. "
                "Fix: give each key a name."
            )
        lines.append(f"{item['name']}:{item['key']}")
    text = "".join(f"{line}\n" for line in lines)
    try:
        serve_keys.parse_keys(text, "serve_api_keys") if lines else None
    except serve_keys.KeyFileError as e:  # "serve_api_keys line N": the file's line N is the list's item N
        message = str(e).replace("serve_api_keys line", "serve_api_keys item")
        raise ServePlanError(f"{message}. Fix: correct that item of serve_api_keys (in the vault).") from None
    return text


def serve_allow_from(networks: Any) -> str:
    """``serve_allow_from`` (addresses or CIDR networks) as ``xeonsd serve --allow-from``'s ``CIDR,CIDR``; '' for
    none (any address). A name that is not an address is refused: the server compares addresses."""
    if networks in (None, ""):
        return ""
    if isinstance(networks, str):
        networks = networks.split(",")
    if isinstance(networks, Mapping) or not isinstance(networks, Sequence):
        raise ServePlanError(f"serve_allow_from is a {type(networks).__name__}: it is a list of addresses or networks")
    out = []
    for item in networks:
        try:
            out.append(str(ipaddress.ip_network(str(item).strip(), strict=False)))
        except ValueError:
            raise ServePlanError(
                f"serve_allow_from: {item!r} is not an IP address or network (CIDR): the servers compare the "
                "client's address. Fix: give the nodes' mpi_address (ansible_host) as IP addresses, or set "
                "serve_allow_from to the front's address(es), e.g. [10.0.0.1, 127.0.0.1]."
            ) from None
    return ",".join(dict.fromkeys(out))


def serve_key_problem(keys: Any) -> str:
    """What :func:`serve_key_file` finds wrong with ``keys``, or '' (for an assert that may print it)."""
    try:
        serve_key_file(keys)
    except ServePlanError as e:
        return str(e)
    return ""


class FilterModule:
    def filters(self) -> dict:
        return {
            "xeonsd_serve_run_dir": serve_plan.run_dir,
            "xeonsd_serve_inference_model": inference_model_of,
            "xeonsd_serve_adapter_runs": serve_plan.adapter_runs,
            "xeonsd_serve_plan": serve_plan_of,
            "xeonsd_serve_argv": serve_argv,
            "xeonsd_serve_files": serve_files,
            "xeonsd_serve_files_to_pull": serve_files_to_pull,
            "xeonsd_haproxy_servers": haproxy_servers,
            "xeonsd_serve_key_file": serve_key_file,
            "xeonsd_serve_key_problem": serve_key_problem,
            "xeonsd_serve_allow_from": serve_allow_from,
        }
