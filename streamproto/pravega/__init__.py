"""
Pravega segment-store wire protocol (WIRE_VERSION 17): the sans-IO codec
(L{codec}), segments on the log store (L{segments}), the server
(L{server}), the writer/reader/admin client (L{client}), the twistd plugin
(L{tap}) and the CLI (L{cli}).  See doc/pravega.rst.
"""
