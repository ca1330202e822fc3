"""TLS credentials for the interop suite, made with GnuTLS's certtool and psktool
(gnutls-bin) in the directory layout nbdkit, QEMU and libnbd read:

  server dir:  ca-cert.pem, server-cert.pem, server-key.pem
  client dir:  ca-cert.pem, client-cert.pem, client-key.pem
  PSK file:    keys.psk ("username:hexkey" lines, as psktool writes them)
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import support

# The client certificate's distinguished name, as GnuTLS (and so qemu-nbd's --tls-authz) prints it.
CLIENT_DN = "CN=client,O=zcnbd tests"
PSK_USER = "alice"


@dataclass(frozen=True)
class Creds:
    server: Path  # ca-cert.pem, server-cert.pem, server-key.pem
    client: Path  # a client certificate signed by the server's CA
    client_no_cert: Path  # only ca-cert.pem: a client without a certificate
    client_other_ca: Path  # a client certificate signed by another CA
    client_expired: Path  # an expired client certificate signed by the server's CA
    psk: Path  # keys.psk with PSK_USER
    psk_wrong: Path  # keys.psk with PSK_USER and another key
    psk_unknown: Path  # a key for a username the server does not know
    psk_dir: Path  # a directory holding keys.psk (QEMU's tls-creds-psk dir=)
    ca: tuple[Path, Path]  # the server's CA: certificate and key (to sign a CRL)
    client_revoked: Path  # a client certificate signed by the server's CA, for revoking


def _certtool(*args) -> None:
    subprocess.run(["certtool", *map(str, args)], check=True, capture_output=True)


def _key(path: Path) -> Path:
    _certtool("--generate-privkey", "--key-type=rsa", "--bits=2048", "--outfile", path)
    os.chmod(path, 0o600)
    return path


def _template(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key = _key(d / f"{name}-key.pem")
    cert = d / f"{name}-cert.pem"
    tmpl = _template(d / f"{name}.info", [f'cn = "{name}"', "ca", "cert_signing_key", "crl_signing_key",
                                         "expiration_days = 30"])
    _certtool("--generate-self-signed", "--load-privkey", key, "--template", tmpl,
              "--outfile", cert)
    return cert, key


def _signed(d: Path, stem: str, ca: tuple[Path, Path], lines: list[str]) -> None:
    key = _key(d / f"{stem}-key.pem")
    tmpl = _template(d / f"{stem}.info", lines)
    _certtool("--generate-certificate", "--load-ca-certificate", ca[0],
              "--load-ca-privkey", ca[1], "--load-privkey", key, "--template", tmpl,
              "--outfile", d / f"{stem}-cert.pem")


def _client_dir(d: Path, ca: tuple[Path, Path], trust: Path, extra: list[str]) -> Path:
    d.mkdir()
    (d / "ca-cert.pem").write_bytes(trust.read_bytes())
    _signed(d, "client", ca, ['organization = "zcnbd tests"', 'cn = "client"',
                              "tls_www_client", "signing_key", "encryption_key", *extra])
    return d


def _psk(path: Path, user: str = PSK_USER) -> Path:
    path.parent.mkdir(exist_ok=True)
    subprocess.run(["psktool", "-u", user, "-p", str(path)], check=True,
                   capture_output=True)
    os.chmod(path, 0o600)
    return path


def make(root: Path) -> Creds:
    support.require_tools("certtool", "psktool")
    cas = root / "cas"
    cas.mkdir()
    ca = _ca(cas, "ca")
    other = _ca(cas, "other-ca")

    server = root / "server"
    server.mkdir()
    (server / "ca-cert.pem").write_bytes(ca[0].read_bytes())
    _signed(server, "server", ca, ['organization = "zcnbd tests"', 'cn = "localhost"',
                                   'dns_name = "localhost"', 'ip_address = "127.0.0.1"',
                                   "tls_www_server", "signing_key", "encryption_key",
                                   "expiration_days = 30"])
    client = _client_dir(root / "client", ca, ca[0], ["expiration_days = 30"])
    no_cert = root / "client-no-cert"
    no_cert.mkdir()
    (no_cert / "ca-cert.pem").write_bytes(ca[0].read_bytes())
    other_ca = _client_dir(root / "client-other-ca", other, ca[0], ["expiration_days = 30"])
    expired = _client_dir(root / "client-expired", ca, ca[0], [
        'activation_date = "2020-01-01 00:00:00 UTC"',
        'expiration_date = "2020-02-01 00:00:00 UTC"',
    ])
    revoked = _client_dir(root / "client-revoked", ca, ca[0], ["expiration_days = 30"])
    psk_dir = root / "psk"
    psk = _psk(psk_dir / "keys.psk")
    psk_wrong = _psk(root / "psk-wrong" / "keys.psk")
    psk_unknown = _psk(root / "psk-unknown" / "keys.psk", user="mallory")
    return Creds(server=server, client=client, client_no_cert=no_cert,
                 client_other_ca=other_ca, client_expired=expired, psk=psk,
                 psk_wrong=psk_wrong, psk_unknown=psk_unknown, psk_dir=psk_dir, ca=ca,
                 client_revoked=revoked)


def revoke(creds: Creds, client_dir: Path, out: Path) -> Path:
    """A revocation list (PEM) by the server's CA naming `client_dir`'s certificate."""
    tmpl = _template(out.with_suffix(".info"), ["crl_next_update = 30", "crl_number = 1"])
    _certtool("--generate-crl", "--load-ca-certificate", creds.ca[0],
              "--load-ca-privkey", creds.ca[1], "--load-certificate",
              client_dir / "client-cert.pem", "--template", tmpl, "--outfile", out)
    return out
