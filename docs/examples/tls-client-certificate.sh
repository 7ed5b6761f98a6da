# A client certificate for one agent host, signed by the CA made above.
cd ~/relay-ca
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout host1.key -out host1.csr -subj "/CN=host1"
printf '%s\n' "extendedKeyUsage=clientAuth" > client.ext
openssl x509 -req -in host1.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
  -out host1.crt -days 825 -extfile client.ext
chmod 600 host1.key
