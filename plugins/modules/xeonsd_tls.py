#!/usr/bin/python
"""Ansible module: a private CA and a server certificate for serve.yml's front (HAProxy), made on the controller
with Python's ``cryptography``, for sites that give no certificate of their own (serve_tls_cert).

The files stay in ``dir`` (mode 0700): ``ca.pem`` (what clients trust: ``curl --cacert``, httpx ``verify=``),
``ca.key``, ``server.pem`` and ``server.key``. The CA is made once and kept; the server certificate is kept while it
is signed by that CA, covers exactly ``names``, matches its key and is valid for more than ``renew_days`` days,
otherwise a new one is issued (so a second run reports no change). Each file is written to a temporary name and
renamed into place, keys with mode 0600. Check mode says what would change and writes nothing.
"""

from __future__ import annotations

import datetime
import ipaddress
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.xeonsd.cluster.plugins.module_utils.xeonsd_atomic import write_atomic

DOCUMENTATION = r"""
module: xeonsd_tls
short_description: A private CA and a server certificate for the names given, kept while they still fit
options:
  dir: {description: The directory of the CA and the certificate (made with mode 0700)., type: path, required: true}
  names: {description: The host names and IP addresses the certificate is for (the first is its common name).,
          type: list, elements: str, required: true}
  days: {description: How long a new server certificate is valid., type: int, default: 825}
  renew_days: {description: A certificate valid for fewer days than this is issued again., type: int, default: 30}
"""

RETURN = r"""
ca: {description: The CA certificate (what clients trust)., type: str}
cert: {description: The server certificate., type: str}
key: {description: The server key., type: str}
issued: {description: Whether a new server certificate was issued (or would be in check mode)., type: bool}
not_after: {description: When the server certificate expires (ISO 8601)., type: str}
"""

CA_DAYS = 3650


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _general_names(names: list[str]) -> list:
    from cryptography import x509

    out = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _load(path: str, kind: str):
    """The certificate or key at ``path``, or None when it is missing or unreadable."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        with open(path, "rb") as f:
            data = f.read()
        if kind == "cert":
            return x509.load_pem_x509_certificate(data)
        return serialization.load_pem_private_key(data, password=None)
    except (OSError, ValueError):
        return None


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _spki(holder) -> bytes:
    """The public key of a private key or a certificate, as DER bytes (to compare them)."""
    from cryptography.hazmat.primitives import serialization

    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return holder.public_key().public_bytes(der, spki)


def _cert(subject, issuer, public_key, signing_key, days: int, extensions: list):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


def make_ca(hostname: str):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"xeonsd serve CA ({hostname})"[:64])])
    exts = [
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (x509.KeyUsage(False, False, False, False, False, True, True, False, False), True),
        (x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False),
    ]
    return key, _cert(name, name, key.public_key(), key, CA_DAYS, exts)


def make_server(ca_key, ca_cert, names: list[str], days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])])
    exts = [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.KeyUsage(True, False, False, False, False, False, False, False, False), True),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        (x509.SubjectAlternativeName(_general_names(names)), False),
        (x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False),
    ]
    return key, _cert(subject, ca_cert.subject, key.public_key(), ca_key, days, exts)


def server_fits(cert, key, ca_cert, names: list[str], renew_days: int) -> bool:
    """Whether the server certificate is ours to keep: signed by the CA, for exactly ``names``, matching its key,
    valid now and for more than ``renew_days`` days."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    if cert is None or key is None or ca_cert is None or cert.issuer != ca_cert.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca_cert)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (InvalidSignature, ValueError, TypeError, x509.ExtensionNotFound):
        return False
    if set(map(repr, sans)) != set(map(repr, _general_names(names))) or _spki(key) != _spki(cert):
        return False
    now = _now()
    return cert.not_valid_before_utc <= now and cert.not_valid_after_utc > now + datetime.timedelta(days=renew_days)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dir": {"type": "path", "required": True},
            "names": {"type": "list", "elements": "str", "required": True},
            "days": {"type": "int", "default": 825},
            "renew_days": {"type": "int", "default": 30},
        },
        supports_check_mode=True,
    )
    p = module.params
    names = list(dict.fromkeys(n.strip() for n in p["names"] if n and n.strip()))
    if not names:
        module.fail_json(msg="xeonsd_tls: names is empty: give the front's host name or address")
    if p["days"] <= p["renew_days"]:
        module.fail_json(msg=f"xeonsd_tls: days ({p['days']}) must be more than renew_days ({p['renew_days']})")
    try:
        from cryptography import x509  # noqa: F401
    except ImportError:
        module.fail_json(msg="xeonsd_tls needs Python's cryptography on the controller: pip install cryptography")
    d = p["dir"]
    files = {k: os.path.join(d, f) for k, f in (("ca", "ca.pem"), ("ca_key", "ca.key"), ("cert", "server.pem"))}
    files["key"] = os.path.join(d, "server.key")
    ca_cert, ca_key = _load(files["ca"], "cert"), _load(files["ca_key"], "key")
    new_ca = ca_cert is None or ca_key is None or _spki(ca_key) != _spki(ca_cert)
    cert, key = _load(files["cert"], "cert"), _load(files["key"], "key")
    issue = new_ca or not server_fits(cert, key, ca_cert, names, p["renew_days"])
    result = {"ca": files["ca"], "cert": files["cert"], "key": files["key"], "issued": issue, "new_ca": new_ca}
    if issue and not module.check_mode:
        from cryptography.hazmat.primitives import serialization

        os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
        if new_ca:
            ca_key, ca_cert = make_ca(names[0])
            write_atomic(files["ca_key"], _pem_key(ca_key), 0o600)
            write_atomic(files["ca"], ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        key, cert = make_server(ca_key, ca_cert, names, p["days"])
        write_atomic(files["key"], _pem_key(key), 0o600)
        write_atomic(files["cert"], cert.public_bytes(serialization.Encoding.PEM), 0o644)
    if cert is not None and not (issue and module.check_mode):
        result["not_after"] = cert.not_valid_after_utc.isoformat()
    module.exit_json(changed=issue, **result)


if __name__ == "__main__":
    main()
