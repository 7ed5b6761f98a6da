# Run from the checkout: makes a small CA outside it and the broker's key and
# certificate in conf/tls/ (which git ignores). POSIX sh; OpenSSL 1.1.1 or later.
CHECKOUT=$PWD

# The CA, in a directory of its own: keep ca.key offline, hand ca.crt to clients.
mkdir -p ~/relay-ca && cd ~/relay-ca
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout ca.key -out ca.crt -days 3650 -subj "/CN=relay CA"
chmod 600 ca.key

# The broker's key and certificate, for every name and address clients use.
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout server.key -out server.csr -subj "/CN=relay.example.org"
printf '%s\n' "subjectAltName=DNS:relay.example.org,DNS:localhost,IP:192.0.2.10,IP:127.0.0.1" \
  "extendedKeyUsage=serverAuth" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
  -out server.crt -days 825 -extfile server.ext
chmod 600 server.key

# Give the broker its pair (and, for client certificates, the CA's certificate).
mkdir -p "$CHECKOUT/conf/tls"
cp server.key server.crt ca.crt "$CHECKOUT/conf/tls/"
cd "$CHECKOUT"
