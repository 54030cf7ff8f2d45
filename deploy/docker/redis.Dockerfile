# The Redis image docker-compose.yml runs, built when a registry is at hand
# (`docker-compose up -d` builds it if the tag in .env does not exist yet).
# Without one, scripts/build-images makes the same tag from this machine's
# redis-server.
FROM redis:7
