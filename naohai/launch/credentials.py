"""Huawei Cloud credentials, endpoints and the optional SDK imports.

Owns three things the ModelArts and OBS modules share: reading the access key,
secret key and project id from the environment (``HUAWEICLOUD_SDK_AK``,
``HUAWEICLOUD_SDK_SK``, ``HUAWEICLOUD_SDK_PROJECT_ID``); keeping the secret out of
anything printed (:meth:`Credentials.redact`, a ``repr`` without it); and importing
the optional SDKs with a UserError that says how to install them.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Mapping, Optional

from naohai.errors import UserError

AK_VAR, SK_VAR, PROJECT_VAR = "HUAWEICLOUD_SDK_AK", "HUAWEICLOUD_SDK_SK", "HUAWEICLOUD_SDK_PROJECT_ID"
INSTALL_HINT = ("install the ModelArts extra: pip install 'naohai[modelarts]' (huaweicloudsdkmodelarts, "
                "huaweicloudsdkcore, esdk-obs-python)")


@dataclass(frozen=True, repr=False)
class Credentials:
    access_key: str
    secret_key: str
    project_id: str

    def __repr__(self) -> str:
        return f"Credentials(access_key={mask(self.access_key)!r}, secret_key='<redacted>', " \
               f"project_id={self.project_id!r})"

    __str__ = __repr__

    def redact(self, text: str) -> str:
        """``text`` with the secret key (and the full access key) replaced."""
        text = str(text)
        if self.secret_key:
            text = text.replace(self.secret_key, "<redacted>")
        if self.access_key:
            text = text.replace(self.access_key, mask(self.access_key))
        return text


def mask(value: str) -> str:
    """First four characters then stars: enough to tell keys apart, not to use them."""
    return (value[:4] + "****") if value else ""


def credentials_from_env(environ: Mapping[str, str]) -> Credentials:
    """Read the three variables; a missing one is a UserError naming it."""
    values = {}
    for var, what in ((AK_VAR, "access key"), (SK_VAR, "secret key"), (PROJECT_VAR, "project id")):
        value = (environ.get(var) or "").strip()
        if not value:
            hint = (" (the project of your region, shown under My Credentials > API Credentials; "
                    "without it the request path is wrong)") if var == PROJECT_VAR else ""
            raise UserError(f"the Huawei Cloud {what} is not set: export {var}{hint}", where="environment",
                            key=var)
        values[var] = value
    return Credentials(values[AK_VAR], values[SK_VAR], values[PROJECT_VAR])


def require(module: str):
    """Import an optional SDK module or raise a UserError with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"the Python module '{module}' is missing; {INSTALL_HINT}", key=module) from None


def _service_endpoint(service: str, flag: str, endpoint: Optional[str], region: Optional[str]) -> str:
    if endpoint:
        return _check_url(endpoint, flag)
    if region:
        return f"https://{service}.{region}.myhuaweicloud.com"
    raise UserError(f"give {flag} URL or --region (e.g. cn-southwest-2)", where="command line", key=flag)


def modelarts_endpoint(endpoint: Optional[str], region: Optional[str]) -> str:
    return _service_endpoint("modelarts", "--endpoint", endpoint, region)


def obs_endpoint(endpoint: Optional[str], region: Optional[str]) -> str:
    return _service_endpoint("obs", "--obs-endpoint", endpoint, region)


def _check_url(url: str, flag: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise UserError(f"'{url}' is not an http(s) URL", where="command line", key=flag)
    return url
