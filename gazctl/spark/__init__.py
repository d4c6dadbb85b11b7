"""The Spark pipeline over fragment stores: a PySpark data source reading journal history straight
from the stores (no broker in the path), `gazctl spark compact` and `gazctl spark replay`.

PySpark is an optional dependency (`pip install 'gazette-py[spark]'`); these modules import it only
where they need it, so gazctl itself does not."""
