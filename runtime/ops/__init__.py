"""The ``hybrid::`` op vocabulary. Importing this package registers every op with torch.library."""
from . import linear, mla, moe, ssm  # noqa: F401
from .mla import dropin, paged  # noqa: F401
from .moe import block  # noqa: F401
from .ssm import mixer  # noqa: F401
from . import run_time  # noqa: E402

run_time.register()
