# No __init__.py in twisted/ or twisted/plugins/: Twisted finds this file on its own.
from twisted.application.service import ServiceMaker

from streamproto.core.tls import TLSServerParser

streamproto = ServiceMaker("streamproto", "streamproto.tap", "Every streamproto server over one log store.", "streamproto")
styxServer = ServiceMaker("styx-server", "streamproto.styx.tap", "Styx durable record log: HTTP API and styx/0.", "styx-server")
pravegaServer = ServiceMaker("pravega-server", "streamproto.pravega.tap", "Pravega segment store (wire protocol).", "pravega-server")
lumberjackServer = ServiceMaker("lumberjack-server", "streamproto.lumberjack.tap", "Lumberjack v1/v2 (Beats) receiver.", "lumberjack-server")
reliableServer = ServiceMaker("reliable-stream-server", "streamproto.reliable.tap", "Reliable JSON line streams.", "reliable-stream-server")
relinkServer = ServiceMaker("relink-server", "streamproto.relink.tap", "Relink multiplexed links.", "relink-server")
tlsServerEndpoint = TLSServerParser()
