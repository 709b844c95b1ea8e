"""Two rules about URLs that settings, logs and errors all need: a host on loopback, and a URL shown without the
password in it."""

import ipaddress
import re

_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def redact_url(text: str) -> str:
    """Every `scheme://user:password@host` in `text` as `scheme://***@host`."""
    return _USERINFO.sub(r"\1***@", text)
