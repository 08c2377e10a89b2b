"""
Lumberjack v1/v2, the Beats / Logstash forwarding protocol: a server that
stores every event durably before acking it, a client with Filebeat's
sending behaviour, and the sans-IO frame codec both use.  See
doc/lumberjack.rst.
"""
