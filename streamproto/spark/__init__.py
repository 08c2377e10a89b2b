"""
PySpark data source and sink over the streamproto log store (issue 8).

Needs the C{[spark]} extra (pyspark >= 4.0, pyarrow).  See doc/spark.rst.
"""

from streamproto.spark.source import LogDataSource, register

__all__ = ["LogDataSource", "register"]
