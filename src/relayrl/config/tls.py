"""The ``tls`` section: TLS (and mutual TLS) on every gRPC server and every channel to one, from PEM files.

One section for the whole run, so one config turns TLS on for every service and every caller consistently: each
gRPC server presents ``cert_file``/``key_file``; every client (the services' channels to one another, the client
library, ``relayrl health/status/control``, the launcher's health checks) verifies servers against ``ca_file``.
With ``require_client_cert`` servers also demand a client certificate signed by ``ca_file`` (mutual TLS); clients
present ``client_cert_file``/``client_key_file``, else the service's own ``cert_file``/``key_file``. All fields
empty (the default): plaintext, as before.

Files are read when a server or channel is created (service start-up), never logged; :meth:`TlsConfig.read`
checks them and names the field of a missing, unreadable or non-PEM file. Rotation: replace the files, restart.
"""

from __future__ import annotations

import logging
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)

CERT_MARK = b"-----BEGIN CERTIFICATE-----"
KEY_MARK = b"PRIVATE KEY-----"


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes a server or channel needs (None where not configured). Never logged or shown."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None
    client_cert: bytes | None
    client_key: bytes | None

    def __repr__(self) -> str:  # a key must not reach a log line through a repr
        return "TlsFiles(<redacted>)"


@dataclass
class TlsConfig:
    cert_file: str = field(
        default="",
        metadata={
            "help": "PEM certificate chain every gRPC server presents (empty, with every other field empty: "
            "plaintext). Its names (SAN) must cover the addresses clients use, or set server_name."
        },
    )
    key_file: str = field(
        default="",
        metadata={
            "help": "PEM private key of cert_file (required with it). Read at start-up, never logged; keep it 0600."
        },
    )
    ca_file: str = field(
        default="",
        metadata={
            "help": "PEM CA bundle clients verify servers against (empty: the system's roots) and, with "
            "require_client_cert, servers verify client certificates against."
        },
    )
    require_client_cert: bool = field(
        default=False, metadata={"help": "Mutual TLS: servers refuse a client without a certificate signed by ca_file."}
    )
    client_cert_file: str = field(
        default="",
        metadata={
            "help": "PEM certificate clients present to servers (mutual TLS; empty: cert_file, which then needs the "
            "clientAuth usage or no extended key usage)."
        },
    )
    client_key_file: str = field(
        default="", metadata={"help": "PEM private key of client_cert_file (required with it)."}
    )
    server_name: str = field(
        default="",
        metadata={
            "help": "Name clients expect in server certificates instead of the host of the address they dial (e.g. "
            "when services are reached by IP and the certificate names a DNS name)."
        },
    )

    @property
    def enabled(self) -> bool:
        """TLS is on for servers and clients as soon as any certificate file is set."""
        return bool(self.cert_file or self.ca_file or self.client_cert_file)

    def validate(self) -> None:
        for cert, key in (("cert_file", "key_file"), ("client_cert_file", "client_key_file")):
            if getattr(self, key) and not getattr(self, cert):
                raise ConfigError(key, getattr(self, key), f"needs {cert} (the certificate of this key)")
            if getattr(self, cert) and not getattr(self, key):
                raise ConfigError(key, "", f"is required with {cert}")
        if self.require_client_cert and not self.ca_file:
            raise ConfigError(
                "ca_file", "", "is required with require_client_cert (servers verify client certificates against it)"
            )
        if self.require_client_cert and not self.cert_file:
            raise ConfigError("cert_file", "", "is required with require_client_cert (servers need a certificate)")
        if self.server_name and not self.enabled:
            raise ConfigError("server_name", self.server_name, "is used only with TLS: set cert_file or ca_file")

    def resolved(self) -> TlsConfig:
        """The same section with absolute paths (a run folder's config.yaml then works from any directory)."""

        def absolute(name: str) -> str:
            return str(Path(name).resolve()) if name else ""

        return replace(
            self,
            cert_file=absolute(self.cert_file),
            key_file=absolute(self.key_file),
            ca_file=absolute(self.ca_file),
            client_cert_file=absolute(self.client_cert_file),
            client_key_file=absolute(self.client_key_file),
        )

    def read(self, path: str = "tls") -> TlsFiles:
        """Read and check every configured file. Raises ConfigError naming the field (``path.field``)."""
        return TlsFiles(
            cert=_read(self.cert_file, f"{path}.cert_file", CERT_MARK),
            key=_read(self.key_file, f"{path}.key_file", KEY_MARK, private=True),
            ca=_read(self.ca_file, f"{path}.ca_file", CERT_MARK),
            client_cert=_read(self.client_cert_file, f"{path}.client_cert_file", CERT_MARK),
            client_key=_read(self.client_key_file, f"{path}.client_key_file", KEY_MARK, private=True),
        )


def _read(name: str, where: str, mark: bytes, private: bool = False) -> bytes | None:
    if not name:
        return None
    path = Path(name)
    try:
        data = path.read_bytes()
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(where, name, "no such file") from None
    except IsADirectoryError:
        raise ConfigError(where, name, "is a directory, not a PEM file") from None
    except OSError as exc:  # permission denied and the like; the message names no content
        raise ConfigError(where, name, f"cannot be read: {exc.strerror or type(exc).__name__}") from None
    if mark not in data:
        what = "a PEM private key" if private else "a PEM certificate"
        raise ConfigError(where, name, f"does not hold {what} ({mark.decode()!r} not found)")
    if private and mode & stat.S_IROTH:
        log.warning("%s (%s) is readable by every user on this machine; make it 0600", where, name)
    return data
