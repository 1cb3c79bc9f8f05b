"""HTTP routes, one module per API area; create_app includes their routers."""
