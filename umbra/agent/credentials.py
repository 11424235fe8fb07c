"""The node credential on disk: written once at pairing, readable only by its owner.

The credential is shown by the server exactly once, so losing it means pairing
again; leaking it lets anyone claim this node's jobs. It is therefore written
atomically (a private temporary file renamed into place) with mode 0600 inside
a 0700 directory, and a file that group or others can read is refused on load,
as ssh refuses a world-readable private key.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import msgspec

from umbra.errors import UmbraError


class CredentialFileError(UmbraError):
    def __init__(self, message: str) -> None:
        super().__init__("credential_file", message)


class StoredCredential(msgspec.Struct, frozen=True, kw_only=True):
    server: str
    node_id: str
    name: str
    credential: str
    scopes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CredentialFile:
    path: Path

    @classmethod
    def default(cls, data_dir: Path) -> "CredentialFile":
        return cls(data_dir / "agent" / "credential.json")

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> StoredCredential:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            raise CredentialFileError(
                f"No credential at {self.path}: pair first with --code (ask an administrator for a pairing code)."
            ) from None
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CredentialFileError(
                f"{self.path} is accessible by other users (mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it."
            )
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=StoredCredential)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise CredentialFileError(f"{self.path} is not a credential file: {exc}") from None

    def check_writable(self) -> None:
        """Fail now if :meth:`save` could not write here: a pairing's credential is shown only once.

        Run before redeeming a code. A credential the server minted but the
        agent could not store would be lost, and the node's name taken.
        """
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.path.parent / f".{self.path.name}.{os.getpid()}.probe"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
        except OSError as exc:
            raise CredentialFileError(f"Cannot write a credential at {self.path}: {exc.strerror or exc}.") from None

    def save(self, credential: StoredCredential) -> None:
        """Write atomically with mode 0600; never overwrites an existing credential."""
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.path.exists():
            raise CredentialFileError(f"{self.path} already holds a credential; remove it to pair again.")
        temporary = directory / f".{self.path.name}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(msgspec.json.encode(credential))
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temporary, 0o600)  # independent of the umask
            os.link(temporary, self.path)  # fails rather than replace a concurrent writer's file
        except FileExistsError:
            raise CredentialFileError(f"{self.path} already holds a credential; remove it to pair again.") from None
        finally:
            temporary.unlink(missing_ok=True)
