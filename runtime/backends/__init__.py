"""Everything that runs in Kiln's pods: builder, engine cache, backends, server."""
